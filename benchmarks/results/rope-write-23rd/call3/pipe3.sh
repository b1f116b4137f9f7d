set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R/rope; cp .scratch/pipe3.sh $R/
SECONDS=0
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), str(i.get('error'))[:2000])" 2>&1 | grep -A20 '^build'
echo "built at ${SECONDS}s"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 tests/ops/_native_sanitize.py rope > $R/sanitizer_rope.log 2>&1 &
SAN=$!
KVFUSE_FAILURE_LOG=$R/failures.txt timeout 200 python3 -m pytest -q -m gpu -n 6 tests/ops/test_rope_kv_write.py \
  tests/ops/test_rope_rotation.py tests/compile/test_rope_fusion.py -p no:cacheprovider --tb=short > $R/gpu_rope.log 2>&1
echo "pytest rc=$? at ${SECONDS}s"; tail -3 $R/gpu_rope.log
wait $SAN; echo "memcheck rc=$? ($(tail -3 $R/sanitizer_rope.log | tr '\n' ' '))"
echo "checks done at ${SECONDS}s"
timeout 250 python3 -m benchmarks.rope_write --out $R/rope > $R/rope/log.txt 2>&1; echo "rope_write rc=$? at ${SECONDS}s"
grep '^|' $R/rope/log.txt | cut -c1-220
tar czf $OUT/pipe3.tgz -C $R . && rm -rf $R
