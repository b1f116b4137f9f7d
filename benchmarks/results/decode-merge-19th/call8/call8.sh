set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/call8.sh $R/
SECONDS=0
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build'
echo "build at ${SECONDS}s"
sum() { grep -o '"mode".*"us": [0-9.]*' $1 | sed 's/"mode": //;s/"batch": //;s/"context": //;s/"splits": //;s/"us": //;s/"//g' | tr '\n' ' '; }
for r in 1 2; do timeout 60 python3 .scratch/ab_cold.py $R/D_$r.json 1 4 fp8,nvfp4 > $R/D_$r.log 2>&1; echo "D $r: $(sum $R/D_$r.log)"; done
timeout 150 python3 -m benchmarks.cache_write --quick --formats bfloat16,fp8_e4m3,nvfp4,fp8_per_token_head --impls kvfuse,kvfuse_native,flashinfer --out $R > $R/cache_write.log 2>&1
echo "cache_write rc=$?"; grep -E "^\|" $R/cache_write.log | tail -14
timeout 90 python3 -m pytest -q -m gpu tests/ops/test_native.py -n 8 -p no:cacheprovider > $R/t_native.log 2>&1; echo "test_native: $(tail -1 $R/t_native.log)"
echo "done at ${SECONDS}s"
tar czf $OUT/call8.tgz -C $R . && rm -rf $R
