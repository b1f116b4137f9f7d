# Issue 17: the landed rows-first order (t: the tree) against h (KVFUSE_ROPE_ROWS_FIRST=0, whose
# kernels are HEAD's, SASS 367 same); every format at 64-2048 tokens, three rounds, builds
# alternating; then the tree's rotary and native GPU tests and memcheck over the rotary cases.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r47d; mkdir -p $R; cp .scratch/call47d.sh $R/; git diff HEAD > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call47d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [h]="-DKVFUSE_ROPE_ROWS_FIRST=0" )
for v in t h; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 64,256,1024,2048 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench h 1; bench t 1; bench t 2; bench h 2; bench h 3; bench t 3; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
run t env PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/ops/_native_sanitize.py rope > $R/memcheck.txt 2>&1; echo "memcheck rc=$? ${SECONDS}s"; tail -2 $R/memcheck.txt
save
run t timeout 420 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py tests/ops/test_native.py > $R/tests.txt 2>&1; echo "tests rc=$? ${SECONDS}s"; tail -3 $R/tests.txt
save; echo "done ${SECONDS}s"
