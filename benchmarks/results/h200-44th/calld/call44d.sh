# The landed tree (unpaired launches for every op below the threshold, rotary tables located before the wait, 16-bit
# rotary writes in unit pairs from 262144 units): the rotary write benchmark for bf16 caches, memcheck of the rows
# kernels and the rotary writes, and the GPU tests of the write test files.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=16
R=/tmp/r; mkdir -p $R; cp .scratch/call44d.sh $R/; git diff HEAD > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call44d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
run() { KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_t PYTHONPATH=/tmp/site:$PWD "$@"; }
run python3 .scratch/s29/build.py t > $R/build_t.log 2>&1; tail -n1 $R/build_t.log; echo "build ${SECONDS}s"
mkdir -p $R/rope; run timeout 60 python3 -m benchmarks.rope_write --quick --tokens 64,256,1024,4096,16384 --formats bfloat16 --out $R/rope > $R/rope/log.txt 2>&1; echo "rope rc=$? ${SECONDS}s"; save
PYTORCH_NO_CUDA_MEMORY_CACHING=1 run timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/ops/_native_sanitize.py rope > $R/sanitizer_rope.log 2>&1; echo "memcheck rope rc=$? ($(tail -2 $R/sanitizer_rope.log | tr '\n' ' ')) ${SECONDS}s"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 run timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 --kernel-name kns=rows_kernel python3 tests/ops/_native_sanitize.py > $R/sanitizer.log 2>&1; echo "memcheck rows rc=$? ($(grep -c 'ERROR SUMMARY: 0 errors' $R/sanitizer.log) clean) ${SECONDS}s"; save
run timeout $((545-SECONDS)) python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py tests/ops/test_native.py > $R/tests.log 2>&1; echo "tests rc=$? ${SECONDS}s"; tail -n 2 $R/tests.log; save
grep '^|' $R/rope/log.txt | cut -c1-250
save; echo "done ${SECONDS}s"
