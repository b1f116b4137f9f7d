# Issue 17: unpaired rotary launches locate their rotation's table columns before the dependent-launch wait (loc,
# the tree's default) against the old order (head); with 16-bit rotary writes unpaired at decode sizes (locu), and
# the scale-less writes (copies, casts) too (locuc). GPU tests and memcheck of the rotary writes on locuc.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=4
R=/tmp/r; mkdir -p $R; cp .scratch/call44b.sh $R/; git diff HEAD -- csrc > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call44b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [head]="-DKVFUSE_ROPE_LOCATE_BEFORE_WAIT=0" [loc]="" [locu]="-DKVFUSE_ROPE_UNPAIRED_16BIT=1" [locuc]="-DKVFUSE_ROPE_UNPAIRED_16BIT=1 -DKVFUSE_UNPAIRED_NO_SCALE=1" )
BUILDS="head loc locu locuc"
for v in $BUILDS; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 50 python3 -m benchmarks.rope_write --quick --out $d --tokens 64,256,1024,4096 --formats bfloat16,fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench head 1; bench loc 1; bench locu 1; bench locuc 1; save
bench locuc 2; bench locu 2; bench loc 2; bench head 2; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
run locuc timeout 200 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py tests/ops/test_native.py > $R/tests_locuc.log 2>&1; echo "tests locuc rc=$? ${SECONDS}s"; tail -n 3 $R/tests_locuc.log; save
PYTORCH_NO_CUDA_MEMORY_CACHING=1 run locuc timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/ops/_native_sanitize.py rope > $R/sanitizer_rope.log 2>&1; echo "memcheck rope rc=$? ($(tail -2 $R/sanitizer_rope.log | tr '\n' ' ')) ${SECONDS}s"; save
if [ $SECONDS -lt 480 ]; then PYTORCH_NO_CUDA_MEMORY_CACHING=1 run locuc timeout $((560-SECONDS)) compute-sanitizer --tool memcheck --error-exitcode 9 --kernel-name kns=rows_kernel python3 tests/ops/_native_sanitize.py > $R/sanitizer.log 2>&1; echo "memcheck rows rc=$? ($(grep -c 'ERROR SUMMARY: 0 errors' $R/sanitizer.log) clean) ${SECONDS}s"; fi
save; echo "done ${SECONDS}s"
