# Issue 17 on the H200: the FP8 widened pairs after their rotation moved into one shared helper (new)
# against 5120793's source (prev), 4096 and 16384 tokens; the FP8 unit-pair GPU tests on new.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=5
R=/tmp/r; mkdir -p $R; cp .scratch/call38e.sh $R/
SECONDS=0
save() { tar czf $OUT/call38e.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/headtree/csrc && cp -r kvfuse benchmarks .scratch /tmp/headtree/ && cp -r csrc/* /tmp/headtree/csrc/ && rm -f /tmp/headtree/kvfuse/csrc && ln -s ../csrc /tmp/headtree/kvfuse/csrc && cp .scratch/head_cache_write.cu /tmp/headtree/csrc/cuda/cache_write.cu
declare -A FLAGS=( [prev]="" [new]="" )
declare -A TREE=( [prev]=/tmp/headtree [new]=$PWD )
for v in prev new; do
  (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
run() { v=$1; shift; (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} "$@"); }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native)"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 80 python3 -m benchmarks.rope_write --quick --out $d --tokens 4096,16384 --formats fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; }
bench prev 1; bench new 1; echo "round 1 ${SECONDS}s"; save
bench new 2; bench prev 2; echo "round 2 ${SECONDS}s"; save
bench prev 3; bench new 3; echo "round 3 ${SECONDS}s"; save
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_new PYTHONPATH=/tmp/site:$PWD timeout 90 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "(unit_pairs or bit_exact) and (e4m3 or e5m2)" > $R/tests_new.log 2>&1; echo "tests new rc=$? ${SECONDS}s"; tail -n 2 $R/tests_new.log; save
grep -h "differ" $R/*/log.txt | sort | uniq -c | head -4
python3 .scratch/s38/summarize26.py $R
save; echo "done ${SECONDS}s"
