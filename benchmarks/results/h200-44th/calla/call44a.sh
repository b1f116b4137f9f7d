# Issue 17: where the 64-token rotary write's extra time goes (ablations a1: no rotation arithmetic or exchange, table
# loads kept; a2: no table loads; a3: neither), and 16-bit rotary writes unpaired at decode sizes (u16), also the
# scale-less writes (uc), against the tree's defaults (head).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=3
R=/tmp/r; mkdir -p $R; cp .scratch/call44a.sh $R/; git diff HEAD -- csrc > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call44a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [head]="" [u16]="-DKVFUSE_ROPE_UNPAIRED_16BIT=1" [uc]="-DKVFUSE_ROPE_UNPAIRED_16BIT=1 -DKVFUSE_UNPAIRED_NO_SCALE=1" [a1]="-DKVFUSE_ROPE_ABLATE=1" [a2]="-DKVFUSE_ROPE_ABLATE=2" [a3]="-DKVFUSE_ROPE_ABLATE=3" )
BUILDS="head u16 uc a1 a2 a3"
for v in $BUILDS; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 50 python3 -m benchmarks.rope_write --quick --out $d --tokens 64,256,4096 --formats bfloat16,fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench head 1; bench u16 1; bench uc 1; bench a1 1; bench a2 1; bench a3 1; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
bench a3 2; bench a2 2; bench a1 2; bench uc 2; bench u16 2; bench head 2; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
save; echo "done ${SECONDS}s"
