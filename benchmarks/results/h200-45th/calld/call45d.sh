# Issue 17: the tree (16-bit rotary writes in unit pairs at every size) against u (rotary launches paired from 131072
# items: NVFP4's unit pairs at 4096 tokens hold key and value rows in one thread, as its write alone does); then
# memcheck of the rotary writes (with 16-bit caches' unpaired pairs) and the GPU tests of the write test files.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r; mkdir -p $R; cp .scratch/call45d.sh $R/; git diff HEAD > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call45d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [u]="-DKVFUSE_ROPE_UNPAIRED_BELOW_ITEMS=131072" )
for v in t u; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 1024,2048,4096 --formats bfloat16,fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t 1; bench u 1; bench u 2; bench t 2; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
PYTORCH_NO_CUDA_MEMORY_CACHING=1 run t timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/ops/_native_sanitize.py rope > $R/sanitizer_rope.log 2>&1; echo "memcheck rope rc=$? ($(tail -2 $R/sanitizer_rope.log | tr '\n' ' ')) ${SECONDS}s"; save
run t timeout $((560-SECONDS)) python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py tests/ops/test_native.py > $R/tests.log 2>&1; echo "tests rc=$? ${SECONDS}s"; tail -n 2 $R/tests.log; save
grep -E "FAILED|Error" $R/tests.log | head -5
save; echo "done ${SECONDS}s"
