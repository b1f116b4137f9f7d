python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/s22c8.sh $R/
SECONDS=0
python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('build', i['built'], i['build_seconds'], i['error'])" > $R/build.log 2>&1; tail -1 $R/build.log; echo "build ${SECONDS}s"
KVFUSE_FAILURE_LOG=$R/failures_not_gpu.txt timeout 420 python3 -m pytest -q -p no:cacheprovider -m "not gpu" -n 15 tests/ops -rfE --durations=10 > $R/tests_ops_not_gpu.log 2>&1; echo "rc=$? notgpu ${SECONDS}s"; grep "^===" $R/failures_not_gpu.txt; tail -1 $R/tests_ops_not_gpu.log
tar czf $OUT/s22c8.tgz -C $R . && rm -rf $R
