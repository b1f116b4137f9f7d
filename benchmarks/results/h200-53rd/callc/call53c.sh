# Issue 17, 53rd session call c: the write alone's paired / unpaired threshold on the H200. t (tree =
# HEAD's kernels) against w (KVFUSE_UNPAIRED_BELOW_ITEMS=65536, rotary writes' threshold kept at
# 262144). Writes alone at 1024-4095 tokens, NVFP4 / FP8 / bf16, three rounds.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r53c; mkdir -p $R; cp .scratch/call53c.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call53c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [w]="-DKVFUSE_UNPAIRED_BELOW_ITEMS=65536 -DKVFUSE_ROPE_UNPAIRED_BELOW_ITEMS=262144" )
for v in t w; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$ROOT python3 $ROOT/.scratch/s53/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$ROOT "$@"; }
bench() { v=$1; r=$2; d=$R/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --quick --out $d --tokens 1024,1536,2048,3072,4095 --formats nvfp4,fp8,bfloat16 --variants "write" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "rope $v $r ${SECONDS}s"; }
for v in t w; do bench $v 1; done; save
for v in w t; do bench $v 2; done; save
for v in t w; do bench $v 3; done; save
python3 .scratch/s53/summarize.py $R > $R/rope_summary.txt; save
cat $R/rope_summary.txt; echo "done ${SECONDS}s"
