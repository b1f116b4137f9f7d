python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/s22c7.sh $R/
SECONDS=0
python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('build', i['built'], i['build_seconds'], i['error'])" > $R/build.log 2>&1; tail -1 $R/build.log; echo "build ${SECONDS}s"
KVFUSE_FAILURE_LOG=$R/failures_not_gpu.txt timeout 230 python3 -m pytest -q -p no:cacheprovider -m "not gpu" -n 14 tests/ops -rfE > $R/tests_ops_not_gpu.log 2>&1; echo "rc=$? notgpu ${SECONDS}s"; grep "^===" $R/failures_not_gpu.txt
KVFUSE_FAILURE_LOG=$R/failures_gpu.txt timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/ops/test_native_attention.py tests/ops/test_quantized_prefill.py tests/ops/test_rope_rotation.py tests/ops/test_rope_kv_write.py -rfE > $R/tests_gpu_touched.log 2>&1; echo "rc=$? gpu ${SECONDS}s"; tail -1 $R/tests_gpu_touched.log; grep "^===" $R/failures_gpu.txt
tar czf $OUT/s22c7.tgz -C $R . && rm -rf $R
