set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/call8.sh .scratch/ab_cold.py $R/
SECONDS=0
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build'
echo "build at ${SECONDS}s"
for r in 1 2 3; do
  timeout 90 python3 .scratch/ab_cold.py $R/c_$r.json 1,2 4,8 nvfp4 > $R/c_$r.log 2>&1 || echo "c $r failed"
  echo "c nvfp4 $r: $(grep -o '"batch".*"us": [0-9.]*' $R/c_$r.log | sed 's/"batch": //;s/"context": //;s/"splits": //;s/"us": //' | tr '\n' ' ')"
done
timeout 60 python3 .scratch/ab_cold.py $R/c_fp8.json 1 4 fp8 > $R/c_fp8.log 2>&1
echo "c fp8: $(grep -o '"batch".*"us": [0-9.]*' $R/c_fp8.log | sed 's/"batch": //;s/"context": //;s/"splits": //;s/"us": //' | tr '\n' ' ')"
echo "done at ${SECONDS}s"
tar czf $OUT/call8.tgz -C $R . && rm -rf $R
