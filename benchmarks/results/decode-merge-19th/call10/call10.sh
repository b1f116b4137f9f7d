set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/call10.sh $R/
SECONDS=0
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build'
sum() { grep -o '"mode".*"us": [0-9.]*' $1 | sed 's/"mode": //;s/"batch": //;s/"context": //;s/"splits": //;s/"us": //;s/"//g' | tr '\n' ' '; }
for r in 1 2; do timeout 60 python3 .scratch/ab_cold.py $R/D_$r.json 1 4,8 fp8,nvfp4 > $R/D_$r.log 2>&1; echo "D $r: $(sum $R/D_$r.log) copy $(grep -o '"copy_gb_per_s": [0-9.]*' $R/D_$r.json)"; done
echo "done at ${SECONDS}s"
tar czf $OUT/call10.tgz -C $R . && rm -rf $R
