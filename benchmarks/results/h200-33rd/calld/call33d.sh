# H200: the native kernels' GPU tests (run_gpu.sh's tests-native files) and the write and decode kernels.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=16
R=/tmp/r; mkdir -p $R; cp .scratch/call33d.sh $R/
save() { tar czf $OUT/call33d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
SECONDS=0
python3 .scratch/s29/build.py head > $R/build.log 2>&1; tail -1 $R/build.log; echo "build ${SECONDS}s"
KVFUSE_FAILURE_LOG=$R/failures.txt timeout 430 python3 -m pytest -v --tb=short -p no:cacheprovider -m gpu -n 14 -rfE \
  tests/ops/test_native.py tests/ops/test_native_attention.py tests/ops/test_per_token_head.py > $R/tests.log 2>&1
echo "pytest rc=$? ${SECONDS}s"
grep -E '^\[gw[0-9]+\].* (FAILED|ERROR) ' $R/tests.log | sed 's/^\[gw[0-9]*\] *//' | head -20
grep -cE '^\[gw[0-9]+\].* PASSED ' $R/tests.log | sed 's/^/passed: /'
tail -n 2 $R/tests.log
save; echo "done ${SECONDS}s"
