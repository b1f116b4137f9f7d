# Issue 17, 52nd session call c: the final tree. compute-sanitizer memcheck over the native write's
# and rotary write's cases; the GPU tests of NVFP4 in the other files that write NVFP4 caches.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=16
R=/tmp/r52c; mkdir -p $R; cp .scratch/call52c.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0
save() { tar czf $OUT/call52c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
export KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_t PYTHONPATH=/tmp/site:$PWD
python3 .scratch/s52/build.py t > $R/build_t.log 2>&1; tail -n 1 $R/build_t.log; echo "build ${SECONDS}s"; save
if grep -l "unavailable" $R/build_t.log; then echo "the build failed"; save; exit 1; fi
for m in "" rope; do
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
    --kernel-name kns=rows_kernel python3 tests/ops/_native_sanitize.py $m > $R/sanitizer_${m:-write}.log 2>&1
  echo "memcheck ${m:-write} rc=$? ${SECONDS}s: $(grep -c 'ERROR SUMMARY: 0 errors' $R/sanitizer_${m:-write}.log) clean summaries, $(grep -c 'ERROR SUMMARY' $R/sanitizer_${m:-write}.log) in all"; tail -2 $R/sanitizer_${m:-write}.log
done; save
left=$((590 - SECONDS))
timeout $left python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider -k "nvfp4 or NVFP4" tests/ops/test_native_attention.py \
  tests/ops/test_quantized_prefill.py tests/ops/test_native_prefill.py tests/ops/test_mixed_formats.py tests/ops/test_head_scales.py \
  tests/ops/test_attention_features.py tests/ops/test_mixed_attention.py tests/compile/test_rope_fusion.py tests/ops/test_native.py > $R/tests.txt 2>&1
echo "tests rc=$? ${SECONDS}s"; grep -E "passed|failed|error" $R/tests.txt | tail -3; grep -E "^FAILED|^ERROR" $R/tests.txt | head -20
save; echo "done ${SECONDS}s"
