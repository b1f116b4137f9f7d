# Issue 17: rotary writes with key and value units in one thread at every size (p0: KVFUSE_ROPE_UNPAIRED_BELOW_ITEMS=0;
# FP8 at 64 tokens then runs 8-element K+V pairs, 32 blocks of 256 threads; p0t: the same in 128-thread blocks), against HEAD.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=5
R=/tmp/r; mkdir -p $R; cp .scratch/call41e.sh $R/
SECONDS=0
save() { tar czf $OUT/call41e.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [head]="" [p0]="-DKVFUSE_ROPE_UNPAIRED_BELOW_ITEMS=0" [p0t]="-DKVFUSE_ROPE_UNPAIRED_BELOW_ITEMS=0 -DKVFUSE_ROPE_FP8_NARROW_THREADS=128" )
for v in head p0 p0t; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"); }
VV="write;rope_k+write (native), f32 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 40 python3 -m benchmarks.rope_write --quick --out $d --tokens 64,256 --formats fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench head 1; bench p0 1; bench p0t 1; save
bench p0t 2; bench p0 2; bench head 2; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
save; echo "done ${SECONDS}s"
