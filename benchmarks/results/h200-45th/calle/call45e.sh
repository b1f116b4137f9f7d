# Issue 17: the tree against f (FP8 unit pairs from 262144 units: single units up to 4096 tokens of 8 x 128) and n
# (NVFP4 in single units at every size), 1024 to 4096 tokens; then the whole rotary write benchmark for bf16 caches
# on the tree (16-bit unit pairs at every size).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=5
R=/tmp/r; mkdir -p $R; cp .scratch/call45e.sh $R/; git diff HEAD > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call45e.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [f]="-DKVFUSE_ROPE_PAIRS_FROM=262144" [n]="-DKVFUSE_ROPE_NVFP4_PAIRS_FROM=1073741824" )
for v in t f n; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 1024,2048,4096 --formats $3 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t 1 fp8,nvfp4; bench f 1 fp8; bench n 1 nvfp4; bench n 2 nvfp4; bench f 2 fp8; bench t 2 fp8,nvfp4; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
mkdir -p $R/rope; run t timeout 90 python3 -m benchmarks.rope_write --quick --tokens 64,256,1024,4096,16384 --formats bfloat16 --out $R/rope > $R/rope/log.txt 2>&1; echo "rope rc=$? ${SECONDS}s"; save
grep '^|' $R/rope/log.txt | cut -c1-250
save; echo "done ${SECONDS}s"
