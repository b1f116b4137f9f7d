# Issue 17, 49th session call d. L = the tree: paired unit-pair launches of 16-bit caches load their
# rows before the table columns (KVFUSE_ROPE_16BIT_PAIRED_ROWS_FIRST=1; call c's s build gained 3-4%
# there at 4096 tokens); t = the same macro at 0 (HEAD's kernels); u = L plus, for FP8 pairs over
# full-width 16-bit tables, the lower columns loaded before the rows and the upper ones after
# (scratch). Then the rotary and native GPU tests and memcheck on L.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=6
R=/tmp/r49d; mkdir -p $R; cp .scratch/call49d.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0
save() { tar czf $OUT/call49d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="-DKVFUSE_ROPE_16BIT_PAIRED_ROWS_FIRST=0" [L]="" [u]="-DKVFUSE_SCRATCH_SPLIT_COLUMNS=1" )
for v in t L u; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s49/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 3072,4096,16384 --formats bfloat16,fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t 1; bench L 1; bench u 1; save
python3 .scratch/s49/summarize.py $R
bench u 2; bench L 2; bench t 2; bench t 3; bench L 3; bench u 3; save
python3 .scratch/s49/summarize.py $R > $R/rope_summary.txt
save
save
run L timeout 330 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py tests/ops/test_native.py > $R/tests_L.txt 2>&1; echo "tests L rc=$? ${SECONDS}s"; tail -n 1 $R/tests_L.txt
save
run L env PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 110 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/ops/_native_sanitize.py rope > $R/memcheck_L.txt 2>&1; echo "memcheck L rc=$? ${SECONDS}s"; tail -n 3 $R/memcheck_L.txt
save
cat $R/rope_summary.txt; echo "done ${SECONDS}s"
