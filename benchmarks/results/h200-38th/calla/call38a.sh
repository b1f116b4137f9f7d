# Issue 17 on the H200: unit-pair rotary writes with their table rows staged in shared memory by
# cp.async (st: FP8 pairs 4 blocks/SM, NVFP4 paired 3, unpaired 5; st4: 5 / 4 / 4) against HEAD.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=5
R=/tmp/r; mkdir -p $R; cp .scratch/call38a.sh $R/
SECONDS=0
save() { tar czf $OUT/call38a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/headtree/csrc && cp -r kvfuse benchmarks .scratch /tmp/headtree/ && cp -r csrc/* /tmp/headtree/csrc/ && rm -f /tmp/headtree/kvfuse/csrc && ln -s ../csrc /tmp/headtree/kvfuse/csrc && cp .scratch/head_cache_write.cu /tmp/headtree/csrc/cuda/cache_write.cu
declare -A FLAGS=( [head]="" [st]="" [st4]="-DKVFUSE_ROPE_STAGED_PAIR_MIN_BLOCKS=5 -DKVFUSE_ROPE_STAGED_PAIR_NVFP4_MIN_BLOCKS=4 -DKVFUSE_ROPE_STAGED_PAIR_NVFP4_UNPAIRED_MIN_BLOCKS=4" )
declare -A TREE=( [head]=/tmp/headtree [st]=$PWD [st4]=$PWD )
for v in head st st4; do
  (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
run() { v=$1; shift; (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} "$@"); }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native)"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 80 python3 -m benchmarks.rope_write --quick --out $d --tokens 4096,16384 --formats nvfp4,fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; }
bench head 1; bench st 1; bench st4 1; echo "round 1 ${SECONDS}s"; save
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_st PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/ops/test_rope_kv_write.py > $R/tests_st.log 2>&1; echo "tests st rc=$? ${SECONDS}s"; tail -n 2 $R/tests_st.log; save
bench st4 2; bench head 2; bench st 2; echo "round 2 ${SECONDS}s"; save
bench st 3; bench st4 3; bench head 3; echo "round 3 ${SECONDS}s"; save
grep -h "differ" $R/*/log.txt | sort | uniq -c | head -4
python3 .scratch/s38/summarize26.py $R
save; echo "done ${SECONDS}s"
