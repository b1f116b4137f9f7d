set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/call9.sh $R/
SECONDS=0
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build'
echo "build at ${SECONDS}s"
timeout 240 python3 -m pytest -q -m gpu tests/models tests/compile tests/integrations tests/ops/test_per_token_head.py --deselect tests/compile/test_rope_fusion.py -n 8 -p no:cacheprovider > $R/t_models.log 2>&1; echo "models/compile/integrations/per-token-head: $(tail -1 $R/t_models.log)"
grep -E "^(FAILED|ERROR)" $R/t_models.log | head -5
echo "done at ${SECONDS}s"
tar czf $OUT/call9.tgz -C $R . && rm -rf $R
