# Issue 17, bf16 caches: where do 16-bit unit pairs win (t: single units below 262144 units; p0: pairs at every size),
# 64 to 2048 tokens; then the clock probe of the writes' slow state.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r; mkdir -p $R; cp .scratch/call45c.sh .scratch/s45/clock_probe.py $R/; git diff HEAD -- csrc > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call45c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [p0]="-DKVFUSE_ROPE_16BIT_PAIRS_FROM=0" )
for v in t p0; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
run t timeout 100 python3 .scratch/s45/clock_probe.py 2>&1 | grep -v Warning | tee $R/clock_probe.txt; save
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 64,128,256,512,1024,2048 --formats bfloat16 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t 1; bench p0 1; bench p0 2; bench t 2; bench t 3; bench p0 3; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
echo "done ${SECONDS}s"; save
