python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/s22c6.sh $R/
SECONDS=0
python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('build', i['built'], i['build_seconds'], i['error'])" > $R/build.log 2>&1; tail -1 $R/build.log; echo "build ${SECONDS}s"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfEs "tests/ops/test_rope_kv_write.py::test_op_through_forced_triton" "tests/ops/test_quantized_prefill.py::test_prefix_partials_are_the_prefix_softmax" > $R/tests_two.log 2>&1; tail -1 $R/tests_two.log; echo "two ${SECONDS}s"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/ops/test_rope_kv_write.py tests/ops/test_rope_rotation.py tests/ops/test_native_attention.py tests/ops/test_quantized_prefill.py -rfE > $R/tests_gpu_touched.log 2>&1; tail -1 $R/tests_gpu_touched.log; echo "gpu ${SECONDS}s"
timeout 260 python3 -m pytest -q -p no:cacheprovider -m "not gpu" -n 14 tests/ops -rfE --durations=15 > $R/tests_ops_not_gpu.log 2>&1; echo "rc=$?"; grep -E "passed|failed" $R/tests_ops_not_gpu.log | tail -2; grep -E "^FAILED|^ERROR" $R/tests_ops_not_gpu.log | head; echo "notgpu ${SECONDS}s"
tar czf $OUT/s22c6.tgz -C $R . && rm -rf $R
