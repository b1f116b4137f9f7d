# Issue 17, 53rd session call d: where the writes alone should switch from unpaired to paired units
# on the H200. t (tree = HEAD's kernels), w (KVFUSE_UNPAIRED_BELOW_ITEMS=65536) for NVFP4 at
# 2304-2816 tokens, f (=1048576, unpaired up to 16383 tokens) for FP8 / bf16 at 4096-16384; the
# rotary writes' threshold kept at 262144 in both. Three rounds.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r53d; mkdir -p $R; cp .scratch/call53d.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call53d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [w]="-DKVFUSE_UNPAIRED_BELOW_ITEMS=65536 -DKVFUSE_ROPE_UNPAIRED_BELOW_ITEMS=262144" [f]="-DKVFUSE_UNPAIRED_BELOW_ITEMS=1048576 -DKVFUSE_ROPE_UNPAIRED_BELOW_ITEMS=262144" )
for v in t w f; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$ROOT python3 $ROOT/.scratch/s53/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$ROOT "$@"; }
bench() { v=$1; r=$2; fmts=$3; toks=$4; d=$R/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --quick --out $d --tokens $toks --formats $fmts --variants "write" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "rope $v $r ${SECONDS}s"; }
N="nvfp4 2304,2560,2816"; F="fp8,bfloat16 4096,6144,8192,16384,32768"
for r in 1 2 3; do
  bench t n$r $N; bench w n$r $N; bench t f$r $F; bench f f$r $F
done; save
python3 .scratch/s53/summarize.py $R > $R/rope_summary.txt; save
cat $R/rope_summary.txt; echo "done ${SECONDS}s"
