# Issue 17, 48th session call b: the tree L (KVFUSE_ROPE_PAIR_FP8_FULL16_SMALL_BLOCKS=9, default) against
# t (=0: b8511b3's kernels) for FP8 over full-width bf16 tables at 64-4096 tokens, three rounds; then
# the rotary and native GPU tests and memcheck on L.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r48b; mkdir -p $R; cp .scratch/call48b.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0
save() { tar czf $OUT/call48b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [L]="" [t]="-DKVFUSE_ROPE_PAIR_FP8_FULL16_SMALL_BLOCKS=0" )
for v in L t; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s48/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native);rope_k+write (native), f32 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 64,256,1024,2048,4096 --formats fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t 1; bench L 1; bench L 2; bench t 2; bench t 3; bench L 3; save
python3 .scratch/s48/summarize.py $R | tee $R/rope_summary.txt
run L timeout 330 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py tests/ops/test_native.py > $R/tests_L.txt 2>&1; echo "tests L rc=$? ${SECONDS}s"; tail -1 $R/tests_L.txt
save
run L env PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/ops/_native_sanitize.py rope > $R/memcheck_L.txt 2>&1; echo "memcheck L rc=$? ${SECONDS}s"; tail -3 $R/memcheck_L.txt
save; echo "done ${SECONDS}s"
