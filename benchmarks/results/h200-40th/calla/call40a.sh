# Issue 17: (1) store_widened_pair folded into store_units (tree; 16 widened FP8 pair kernels change SASS) against
# HEAD; (2) NVFP4 unpaired unit-pair rotary writes at 9 / 10 resident 128-thread blocks (m1152: 56 registers, 36/44
# bytes spilled; m1280: 48); (3) small FP8 rotary writes' 8-element units in 512-thread blocks (n512).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=4
R=/tmp/r; mkdir -p $R; cp .scratch/call40a.sh $R/; git diff HEAD -- csrc > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call40a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/headtree/csrc && cp -r kvfuse benchmarks .scratch /tmp/headtree/ && cp -r csrc/* /tmp/headtree/csrc/ && rm -f /tmp/headtree/kvfuse/csrc && ln -s ../csrc /tmp/headtree/kvfuse/csrc && cp .scratch/head_cache_write.cu /tmp/headtree/csrc/cuda/cache_write.cu
declare -A FLAGS=( [head]="" [fold]="" [m1152]="-DKVFUSE_ROPE_PAIR_NVFP4_UNPAIRED_MIN_THREADS=1152" [m1280]="-DKVFUSE_ROPE_PAIR_NVFP4_UNPAIRED_MIN_THREADS=1280" [n512]="-DKVFUSE_ROPE_FP8_NARROW_THREADS=512" )
declare -A TREE=( [head]=/tmp/headtree [fold]=$PWD [m1152]=$PWD [m1280]=$PWD [n512]=$PWD )
for v in head fold m1152 m1280 n512; do
  (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
run() { v=$1; shift; (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} "$@"); }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 80 python3 -m benchmarks.rope_write --quick --out $d --tokens 64,1024,4096,16384 --formats fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench head 1; bench fold 1; bench m1152 1; bench m1280 1; bench n512 1
bench n512 2; bench m1280 2; bench m1152 2; bench fold 2; bench head 2
bench fold 3; bench m1152 3; bench head 3; bench n512 3; bench m1280 3; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_fold PYTHONPATH=/tmp/site:$PWD timeout $((560-SECONDS)) python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py > $R/tests_fold.log 2>&1; echo "tests fold rc=$? ${SECONDS}s"; tail -n 3 $R/tests_fold.log
save; echo "done ${SECONDS}s"
