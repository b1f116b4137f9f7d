set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/call9.sh $R/
SECONDS=0
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build'
timeout 330 python3 -m pytest -v --tb=short -m gpu -n 8 tests/models tests/compile tests/integrations tests/ops/test_per_token_head.py \
  --ignore tests/models/test_memory.py -p no:cacheprovider -rfE > $R/gpu_models.log 2>&1
echo "pytest rc=$? at ${SECONDS}s"
grep -E '^\[gw[0-9]+\].* (FAILED|ERROR) ' $R/gpu_models.log | sed 's/^\[gw[0-9]*\] *//' | head -20
grep -cE '^\[gw[0-9]+\].* PASSED ' $R/gpu_models.log | sed 's/^/passed: /'
tail -2 $R/gpu_models.log
tar czf $OUT/call9.tgz -C $R . && rm -rf $R
