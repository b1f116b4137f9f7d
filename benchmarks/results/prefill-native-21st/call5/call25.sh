python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=16
SECONDS=0
python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('build', i['built'], i['build_seconds'], i['error'])"
KVFUSE_FAILURE_LOG=$OUT/failures.txt timeout 470 python3 -m pytest -q -p no:cacheprovider -n 14 tests/ops tests/test_*.py -rfE > $OUT/tests_ops_all.log 2>&1; echo "rc=$? ${SECONDS}s"
grep -E "^FAILED|^ERROR" $OUT/tests_ops_all.log | sed 's/ - .*//' | awk -F'::' '{print $1}' | sort | uniq -c
tail -2 $OUT/tests_ops_all.log
