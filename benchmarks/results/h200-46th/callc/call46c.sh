# Issue 17: the tree (FP8 / NVFP4 unpaired unit-pair launches of 1-2 waves prefetch the rows one wave ahead into
# L2, KVFUSE_ROPE_PREFETCH=1) against t0 (KVFUSE_ROPE_PREFETCH=0: HEAD's kernels, SASS for SASS): 1024-4096
# tokens, every format, three rounds in alternating order; the GPU tests and memcheck on the tree.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/rc; mkdir -p $R; cp .scratch/call46c.sh $R/; git diff HEAD > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call46c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [t0]="-DKVFUSE_ROPE_PREFETCH=0" )
for v in t t0; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 80 python3 -m benchmarks.rope_write --quick --out $d --tokens 1024,2048,3072,4096 --formats fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t0 1; bench t 1; bench t 2; bench t0 2; bench t0 3; bench t 3; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
run t env PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/ops/_native_sanitize.py rope > $R/memcheck.txt 2>&1; echo "memcheck rc=$? ${SECONDS}s"; tail -2 $R/memcheck.txt; save
run t timeout 330 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py tests/ops/test_native.py > $R/tests.txt 2>&1; echo "tests rc=$? ${SECONDS}s"; tail -3 $R/tests.txt
save; echo "done ${SECONDS}s"
