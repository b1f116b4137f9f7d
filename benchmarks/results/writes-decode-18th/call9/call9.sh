set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/call9.sh $R/
SECONDS=0
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build'
timeout 120 python3 -m pytest -v -m gpu tests/ops/test_native.py -k "dependents or capture or routing" -p no:cacheprovider --tb=short > $R/gpu_tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "PASSED|FAILED|ERROR" $R/gpu_tests.log | sed 's/.*:://' | head -20; tail -1 $R/gpu_tests.log
tar czf $OUT/call9.tgz -C $R . && rm -rf $R
