# Issue 17 / the writes: 128-thread small blocks with 8-element rotary units kept at 256 (new, the working tree's
# default) against HEAD (256) and 64-thread blocks (s64); the write and the rotary write over f32 half tables,
# every format, 64..16384 tokens; GPU tests of the new default.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=5
R=/tmp/r; mkdir -p $R; cp .scratch/call39c.sh $R/; git diff HEAD -- csrc > $R/small_blocks.patch
SECONDS=0
save() { tar czf $OUT/call39c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/headtree/csrc && cp -r kvfuse benchmarks .scratch /tmp/headtree/ && cp -r csrc/* /tmp/headtree/csrc/ && rm -f /tmp/headtree/kvfuse/csrc && ln -s ../csrc /tmp/headtree/kvfuse/csrc && cp .scratch/head_cache_write.cu /tmp/headtree/csrc/cuda/cache_write.cu
declare -A FLAGS=( [head]="" [new]="" [s64]="-DKVFUSE_SMALL_THREADS=64" )
declare -A TREE=( [head]=/tmp/headtree [new]=$PWD [s64]=$PWD )
for v in head new s64; do
  (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
run() { v=$1; shift; (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} "$@"); }
VV="write;rope_k+write (native), f32 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 80 python3 -m benchmarks.rope_write --quick --out $d --tokens 64,256,1024,4096,16384 --formats bfloat16,fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench head 1; bench new 1; bench s64 1; bench s64 2; bench head 2; bench new 2; bench new 3; bench s64 3; bench head 3; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_new PYTHONPATH=/tmp/site:$PWD timeout $((545-SECONDS)) python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_native.py tests/ops/test_rope_kv_write.py tests/ops/test_per_token_head.py tests/ops/test_nvfp4_page_layout.py > $R/tests_new.log 2>&1; echo "tests new rc=$? ${SECONDS}s"; tail -n 3 $R/tests_new.log
save; echo "done ${SECONDS}s"
