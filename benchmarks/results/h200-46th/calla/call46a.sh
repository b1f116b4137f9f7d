# Issue 17: unpaired unit-pair rotary launches of more than one wave, with the first wave prefetching
# into L2 the rows and table columns of the item one wave ahead (p: KVFUSE_ROPE_PREFETCH=1) against the
# tree without (t, HEAD's SASS); 2048 and 4096 tokens, every format, three rounds in alternating order.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=5
R=/tmp/r; mkdir -p $R; cp .scratch/call46a.sh $R/; git diff HEAD > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call46a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [p]="-DKVFUSE_ROPE_PREFETCH=1" )
for v in t p; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 80 python3 -m benchmarks.rope_write --quick --out $d --tokens 2048,4096 --formats bfloat16,fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t 1; bench p 1; bench p 2; bench t 2; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
bench t 3; bench p 3; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
save; echo "done ${SECONDS}s"
