set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R/rope $R/qk; cp .scratch/pipe9.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid --format=csv | tee $R/gpu.csv
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), str(i.get('error'))[:2000])" 2>&1 | grep -A20 '^build'
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 220 compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 tests/ops/_native_sanitize.py rope > $R/sanitizer_rope.log 2>&1 &
SAN=$!
KVFUSE_FAILURE_LOG=$R/failures.txt timeout 240 python3 -m pytest -q -m gpu -n 6 tests/ops/test_rope_kv_write.py \
  tests/ops/test_rope_rotation.py tests/compile/test_rope_fusion.py -p no:cacheprovider --tb=short > $R/gpu_rope.log 2>&1
echo "pytest rc=$? at ${SECONDS}s"; tail -2 $R/gpu_rope.log; grep -E "FAILED|ERROR" $R/gpu_rope.log | head -5
wait $SAN; echo "memcheck rc=$? ($(tail -3 $R/sanitizer_rope.log | tr '\n' ' '))"
timeout 200 python3 -m benchmarks.rope_write --out $R/rope > $R/rope/log.txt 2>&1; echo "rope_write rc=$? at ${SECONDS}s"
grep '^|' $R/rope/log.txt | cut -c1-260
timeout 60 python3 -m benchmarks.rope_write --quick --out $R/qk --tokens 64,1024,4096 --formats bfloat16,fp8,nvfp4 \
  --variants "rope_qk+write (native);rope_qk+write (triton)" > $R/qk/log.txt 2>&1; echo "qk rc=$? at ${SECONDS}s"
grep '^|' $R/qk/log.txt | cut -c1-200
tar czf $OUT/pipe9.tgz -C $R . && rm -rf $R
