# Issue 17 and the writes: the landed tree (scale dividers after the loads, indices before the wait in unpaired launches)
# against HEAD (7285b4c) in benchmarks.cache_write (kvfuse_native), the whole rotary write benchmark at the tree,
# compute-sanitizer memcheck of the rows kernels and the rotary writes, and the GPU tests of the other write test files.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r; mkdir -p $R; cp .scratch/call43c.sh $R/; git diff HEAD -- csrc > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call43c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/headtree/csrc && cp -r kvfuse benchmarks tests .scratch /tmp/headtree/ && cp -r csrc/* /tmp/headtree/csrc/ && rm -f /tmp/headtree/kvfuse/csrc && ln -s ../csrc /tmp/headtree/kvfuse/csrc && cp .scratch/head_cache_write.cu /tmp/headtree/csrc/cuda/cache_write.cu
declare -A TREE=( [head]=/tmp/headtree [t]=$PWD )
for v in head t; do
  (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v PYTHONPATH=/tmp/site:${TREE[$v]} python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v PYTHONPATH=/tmp/site:${TREE[$v]} "$@"); }
mkdir -p $R/rope; run t timeout 150 python3 -m benchmarks.rope_write --quick --out $R/rope > $R/rope/log.txt 2>&1; echo "rope rc=$? ${SECONDS}s"; save
for v in head t; do
  mkdir -p $R/cw_$v; run $v timeout 90 python3 -m benchmarks.cache_write --impls kvfuse_native --formats fp8_e4m3,nvfp4 --out $R/cw_$v > $R/cw_$v/log.txt 2>&1; echo "cache_write $v rc=$? ${SECONDS}s"
done; save
PYTORCH_NO_CUDA_MEMORY_CACHING=1 run t timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 --kernel-name kns=rows_kernel python3 tests/ops/_native_sanitize.py > $R/sanitizer.log 2>&1; echo "memcheck rows rc=$? ($(grep -c 'ERROR SUMMARY: 0 errors' $R/sanitizer.log) clean) ${SECONDS}s"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 run t timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/ops/_native_sanitize.py rope > $R/sanitizer_rope.log 2>&1; echo "memcheck rope rc=$? ($(tail -2 $R/sanitizer_rope.log | tr '\n' ' ')) ${SECONDS}s"; save
run t timeout $((540-SECONDS)) python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_nvfp4_page_layout.py tests/ops/test_mixed_formats.py tests/ops/test_head_scales.py tests/ops/test_flashinfer.py > $R/tests_t.log 2>&1; echo "tests rc=$? ${SECONDS}s"; tail -n 2 $R/tests_t.log
grep '^|' $R/rope/log.txt | cut -c1-220
for v in head t; do echo "== cache_write $v"; grep '^|' $R/cw_$v/log.txt | cut -c1-160 | head -40; done
save; echo "done ${SECONDS}s"
