set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KVFUSE_NATIVE_BUILD_DIR=/tmp/kvb BENCH_COMMIT=$(cat .scratch/commit)
R=$OUT/r; mkdir -p $R; cp .scratch/call25b.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid --format=csv | tee $R/gpu.csv
MAX_JOBS=12 python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), str(i.get('error'))[:1500])" 2>&1 | grep -A20 '^build'
echo "build checked at ${SECONDS}s"
KVFUSE_FAILURE_LOG=$R/failures.txt timeout 330 python3 -m pytest -q -m gpu -n 8 tests/ops/test_rope_kv_write.py \
  tests/ops/test_rope_rotation.py tests/compile/test_rope_fusion.py -p no:cacheprovider > $R/gpu_rope.log 2>&1
echo "tests rc=$? at ${SECONDS}s: $(tail -1 $R/gpu_rope.log)"; head -c 2000 $R/failures.txt 2>/dev/null
grep -E "^(FAILED|ERROR)" $R/gpu_rope.log | head -10
timeout 150 python3 -m pytest -q tests/integrations/test_transformers.py -k rotary_fusion -p no:cacheprovider > $R/integ.log 2>&1
echo "integration (CPU models on the GPU host) rc=$? at ${SECONDS}s: $(tail -1 $R/integ.log)"
tar czf $OUT/call25b.tgz -C $R . && rm -rf $R
