# Issue 17: unpaired unit-pair rotary launches of more than one wave in a kernel whose first wave prefetches
# into L2 what the thread a whole number of tokens ahead loads: p1 rows and table columns, p2 rows only,
# addresses by precomputed byte steps; against t (HEAD's SASS). 2048, 3072 and 4096 tokens, every format,
# three rounds in alternating order; then memcheck over the rotary cases on p1.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=5
R=/tmp/rb; mkdir -p $R; cp .scratch/call46b.sh $R/; git diff HEAD > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call46b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [p1]="-DKVFUSE_ROPE_PREFETCH=1" [p2]="-DKVFUSE_ROPE_PREFETCH=2" )
for v in t p1 p2; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 80 python3 -m benchmarks.rope_write --quick --out $d --tokens 2048,3072,4096 --formats bfloat16,fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t 1; bench p1 1; bench p2 1; bench p2 2; bench p1 2; bench t 2; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
bench t 3; bench p1 3; bench p2 3; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
run p1 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 250 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/ops/_native_sanitize.py rope > $R/memcheck_p1.txt 2>&1; echo "memcheck rc=$? ${SECONDS}s"; tail -3 $R/memcheck_p1.txt
save; echo "done ${SECONDS}s"
