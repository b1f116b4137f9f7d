# Issue 17 and the writes: the tree (t: unpaired launches for every op below the threshold, rotary tables located
# before the wait) against two variants (tf: table loads before the row load in unpaired rotary launches; p16: 16-bit
# rotary writes in unit pairs from 65536 units), the whole rotary write benchmark at t, and the bf16 write alone at
# HEAD (59d2432) against t.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=4
R=/tmp/r; mkdir -p $R; cp .scratch/call44c.sh $R/; git diff HEAD -- csrc > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call44c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/headtree/csrc && cp -r kvfuse benchmarks .scratch /tmp/headtree/ && cp -r csrc/* /tmp/headtree/csrc/ && rm -f /tmp/headtree/kvfuse/csrc && ln -s ../csrc /tmp/headtree/kvfuse/csrc && cp .scratch/head_cache_write.cu /tmp/headtree/csrc/cuda/cache_write.cu
declare -A FLAGS=( [head]="" [t]="" [tf]="-DKVFUSE_ROPE_TABLES_FIRST=1" [p16]="-DKVFUSE_ROPE_PAIRS_16BIT_CACHE=1" )
declare -A TREE=( [head]=/tmp/headtree [t]=$PWD [tf]=$PWD [p16]=$PWD )
for v in head t tf p16; do
  (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} "$@"); }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 50 python3 -m benchmarks.rope_write --quick --out $d --tokens 64,256,1024,4096,16384 --formats bfloat16,fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t 1; bench tf 1; bench p16 1; bench p16 2; bench tf 2; bench t 2; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
mkdir -p $R/rope; run t timeout 150 python3 -m benchmarks.rope_write --quick --out $R/rope > $R/rope/log.txt 2>&1; echo "rope rc=$? ${SECONDS}s"; save
for v in head t; do
  mkdir -p $R/cw_$v; run $v timeout 60 python3 -m benchmarks.cache_write --impls kvfuse_native --formats bfloat16 --out $R/cw_$v > $R/cw_$v/log.txt 2>&1; echo "cache_write $v rc=$? ${SECONDS}s"
done; save
grep '^|' $R/rope/log.txt | cut -c1-220
for v in head t; do echo "== cache_write $v"; grep '^|' $R/cw_$v/log.txt | cut -c1-160 | head -20; done
save; echo "done ${SECONDS}s"
