# Issue 17, 48th session call a. (1) Correctness leftovers on the tree t (b8511b3 kernels; the scratch
# macro is 0): test_gpu_native_16bit_caches (incl. 2053 tokens), unit-pair tests, memcheck with the
# paired 3100-token cases. (2) FP8 pairs over full-width 16-bit tables at 9 / 10 resident 128-thread
# blocks (g9, g10: KVFUSE_SCRATCH_FP8_FULL16_BLOCKS) vs t, on the benchmark's full bf16 tables column.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=6
R=/tmp/r48a; mkdir -p $R; cp .scratch/call48a.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0
save() { tar czf $OUT/call48a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [g]="-DKVFUSE_SCRATCH_FP8_FULL16_BLOCKS=9" [h]="-DKVFUSE_SCRATCH_FP8_FULL16_BLOCKS=10" )
for v in t g h; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s48/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native);rope_k+write (native), f32 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 2048,3072,4096 --formats fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t 1; bench g 1; bench h 1; bench h 2; bench g 2; bench t 2; bench t 3; bench g 3; bench h 3; save
python3 .scratch/s48/summarize.py $R | tee $R/rope_summary.txt
run t timeout 150 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "16bit_caches or unit_pairs" > $R/tests_t.txt 2>&1; echo "tests t rc=$? ${SECONDS}s"; tail -1 $R/tests_t.txt
save
run t env PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/ops/_native_sanitize.py rope > $R/memcheck_t.txt 2>&1; echo "memcheck t rc=$? ${SECONDS}s"; tail -3 $R/memcheck_t.txt
save; echo "done ${SECONDS}s"
