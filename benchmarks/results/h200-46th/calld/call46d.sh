# Issue 17: FP8 / bf16 rotary writes at 2560-3584 tokens with key and value pairs in one thread from 196608
# pair items (u: KVFUSE_ROPE_UNPAIRED_BELOW_ITEMS=196608, 3072 tokens of 8 x 128 in 8-element pairs) against the
# tree (t, 1a12a2f: from 262144); three rounds; then the whole rotary write benchmark on the tree.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/rd; mkdir -p $R; cp .scratch/call46d.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse --short HEAD > $R/commit.txt
SECONDS=0
save() { tar czf $OUT/call46d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [u]="-DKVFUSE_ROPE_UNPAIRED_BELOW_ITEMS=196608" )
for v in t u; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 80 python3 -m benchmarks.rope_write --quick --out $d --tokens 2560,3072,3584 --formats bfloat16,fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t 1; bench u 1; bench u 2; bench t 2; bench t 3; bench u 3; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
mkdir -p $R/rope; run t timeout 240 python3 -m benchmarks.rope_write --quick --tokens 64,256,1024,2048,4096,16384 --out $R/rope > $R/rope/log.txt 2>&1; echo "rope rc=$? ${SECONDS}s"; save
grep '^|' $R/rope/log.txt | cut -c1-260
save; echo "done ${SECONDS}s"
