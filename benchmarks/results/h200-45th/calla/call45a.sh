# Issue 17: the rotary write's slots located before the rotation (t: unpaired launches, the default; t2: every rotary
# launch) against h (KVFUSE_ROPE_PAGES_BEFORE_ROTATION=0, whose SASS equals 4d423ed's); then the variant-order probe
# of the forty-fourth session's "not explained" on t.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=5
R=/tmp/r; mkdir -p $R; cp .scratch/call45a.sh .scratch/s44/order_probe.py $R/; git diff HEAD -- csrc > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call45a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [h]="-DKVFUSE_ROPE_PAGES_BEFORE_ROTATION=0" [t]="" [t2]="-DKVFUSE_ROPE_PAGES_BEFORE_ROTATION=2" )
for v in h t t2; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 50 python3 -m benchmarks.rope_write --quick --out $d --tokens 64,256,1024,4096 --formats bfloat16,fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t 1; bench h 1; bench t2 1; bench t2 2; bench h 2; bench t 2; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
run t timeout 70 python3 .scratch/s44/order_probe.py bfloat16,fp8 2>&1 | grep -v Warning > $R/order.txt; echo "order ${SECONDS}s"; save
cat $R/order.txt
save; echo "done ${SECONDS}s"
