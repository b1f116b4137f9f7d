# Issue 17, 53rd session call f: rotary writes' unpaired threshold (NVFP4 and 16-bit unit pairs,
# single-unit rotations) at 163840 items (r) against the tree's 262144 (t), 5120-8192 tokens.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r53f; mkdir -p $R; cp .scratch/call53f.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call53f.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [r]="-DKVFUSE_ROPE_UNPAIRED_BELOW_ITEMS=163840" )
for v in t r; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$ROOT python3 $ROOT/.scratch/s53/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$ROOT "$@"; }
bench() { local v=$1 r=$2; local d=$R/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --quick --out $d --tokens 5120,6144,8192 --formats nvfp4,bfloat16 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "rope $v $r ${SECONDS}s"; }
bench t 1; bench r 1; bench r 2; bench t 2; save
python3 .scratch/s53/summarize.py $R > $R/rope_summary.txt; save; cat $R/rope_summary.txt; echo "done ${SECONDS}s"
