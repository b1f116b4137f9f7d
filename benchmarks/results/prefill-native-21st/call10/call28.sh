python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=16
SECONDS=0
python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('build', i['built'], i['build_seconds'], i['error'])"
ldd ~/.cache/kvfuse/native/*/*.so | grep -E "stdc|gcc_s"
for c in mode scale input cache cuda_scale; do timeout 60 python3 .scratch/segv_probe.py $c 2>&1 | tail -1; done
KVFUSE_FAILURE_LOG=$OUT/failures_targeted.txt timeout 200 python3 -m pytest -q -p no:cacheprovider -n 14 tests/ops/test_head_scales.py tests/ops/test_nvfp4_page_layout.py tests/ops/test_per_token_head.py tests/ops/test_rope_rotation.py tests/ops/test_quantized_prefill.py tests/ops/test_native_attention.py "tests/ops/test_native.py::test_cpu_refuses_nvfp4_cache_not_contiguous_within_a_page" -rfE > $OUT/tests_targeted.log 2>&1; echo "targeted rc=$? ${SECONDS}s"; grep -E "^FAILED|^ERROR" $OUT/tests_targeted.log | head -20; tail -1 $OUT/tests_targeted.log
KVFUSE_FAILURE_LOG=$OUT/failures_ops.txt timeout $((540 - SECONDS)) python3 -m pytest -q -p no:cacheprovider -n 14 tests/ops tests/test_*.py -rfE --deselect tests/ops/test_rope_rotation.py --deselect tests/ops/test_head_scales.py --deselect tests/ops/test_nvfp4_page_layout.py --deselect tests/ops/test_per_token_head.py --deselect tests/ops/test_quantized_prefill.py --deselect tests/ops/test_native_attention.py > $OUT/tests_ops.log 2>&1; echo "ops rc=$? ${SECONDS}s"
grep "^=== " $OUT/failures_ops.txt 2>/dev/null | sed 's/\[.*//' | sort | uniq -c | head -20; grep -c "cannot be accessed" $OUT/failures_ops.txt 2>/dev/null; tail -c 300 $OUT/tests_ops.log
