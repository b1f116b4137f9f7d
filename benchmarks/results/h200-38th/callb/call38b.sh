# Issue 17 on the H200: unit-pair rotary writes of bf16 keys handing the encode floats rounded by a
# zero-partner convert (w), and single units at 4096 tokens for NVFP4 and FP8 (su), against HEAD.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=5
R=/tmp/r; mkdir -p $R; cp .scratch/call38b.sh $R/
SECONDS=0
save() { tar czf $OUT/call38b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/headtree/csrc && cp -r kvfuse benchmarks .scratch /tmp/headtree/ && cp -r csrc/* /tmp/headtree/csrc/ && rm -f /tmp/headtree/kvfuse/csrc && ln -s ../csrc /tmp/headtree/kvfuse/csrc && cp .scratch/head_cache_write.cu /tmp/headtree/csrc/cuda/cache_write.cu
declare -A FLAGS=( [head]="" [w]="" [su]="-DKVFUSE_ROPE_NVFP4_PAIRS_FROM=300000 -DKVFUSE_ROPE_PAIRS_FROM=300000" )
declare -A TREE=( [head]=/tmp/headtree [w]=$PWD [su]=$PWD )
for v in head w su; do
  (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
run() { v=$1; shift; (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} "$@"); }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native)"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 80 python3 -m benchmarks.rope_write --quick --out $d --tokens 4096,16384 --formats nvfp4,fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; }
bench head 1; bench w 1; bench su 1; echo "round 1 ${SECONDS}s"; save
bench su 2; bench head 2; bench w 2; echo "round 2 ${SECONDS}s"; save
bench w 3; bench su 3; bench head 3; echo "round 3 ${SECONDS}s"; save
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_w PYTHONPATH=/tmp/site:$PWD timeout 170 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "unit_pairs or bit_exact or prefill_shapes or special" > $R/tests_w.log 2>&1; echo "tests w rc=$? ${SECONDS}s"; tail -n 2 $R/tests_w.log; save
grep -h "differ" $R/*/log.txt | sort | uniq -c | head -4
python3 .scratch/s38/summarize26.py $R
save; echo "done ${SECONDS}s"
