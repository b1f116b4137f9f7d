set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/call3.sh $R/
SECONDS=0
E0="-DKVFUSE_DECODE_EARLY_PROLOGUE=0"; S4="-DKVFUSE_DECODE_NVFP4_STAGES=4"
build() { KVFUSE_NATIVE_CUDA_FLAGS="$1" python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build' | sed "s/^/[$2] /"; }
build "" E & build "$E0" E0 & build "$S4" S4 & wait
echo "builds at ${SECONDS}s"
sum() { grep -o '"mode".*"us": [0-9.]*' $1 | sed 's/"mode": //;s/"batch": //;s/"context": //;s/"splits": //;s/"us": //;s/"//g' | tr '\n' ' '; }
for r in 1 2 3; do
  timeout 60 python3 .scratch/ab_cold.py $R/E_$r.json 1 4 fp8,nvfp4 > $R/E_$r.log 2>&1; echo "E $r: $(sum $R/E_$r.log)"
  KVFUSE_NATIVE_CUDA_FLAGS="$E0" timeout 60 python3 .scratch/ab_cold.py $R/E0_$r.json 1 4 fp8,nvfp4 > $R/E0_$r.log 2>&1; echo "E0 $r: $(sum $R/E0_$r.log)"
  KVFUSE_NATIVE_CUDA_FLAGS="$S4" timeout 60 python3 .scratch/ab_cold.py $R/S4_$r.json 1 4 nvfp4 > $R/S4_$r.log 2>&1; echo "S4 $r: $(sum $R/S4_$r.log)"
done
echo "timings at ${SECONDS}s"
timeout 200 python3 -m pytest -q -m gpu tests/ops/test_native_attention.py -n 8 -p no:cacheprovider > $R/t_attn_E.log 2>&1; echo "E test_native_attention: $(tail -1 $R/t_attn_E.log)"
grep -E "^(FAILED|ERROR)" $R/t_attn_E.log | head -5
echo "done at ${SECONDS}s"
tar czf $OUT/call3.tgz -C $R . && rm -rf $R
