set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/call6.sh $R/
SECONDS=0
W8="-DKVFUSE_DECODE_NVFP4_PAIR_WARPS=8"
build() { KVFUSE_NATIVE_CUDA_FLAGS="$1" python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build' | sed "s/^/[$2] /"; }
build "" D & build "$W8" W8 & wait
echo "builds at ${SECONDS}s"
sum() { grep -o '"mode".*"us": [0-9.]*' $1 | sed 's/"mode": //;s/"batch": //;s/"context": //;s/"splits": //;s/"us": //;s/"//g' | tr '\n' ' '; }
for r in 1 2 3; do
  timeout 60 python3 .scratch/ab_cold.py $R/Dfp8_$r.json 1 4 fp8 > $R/Dfp8_$r.log 2>&1; echo "D $r: $(sum $R/Dfp8_$r.log)"
  timeout 60 python3 .scratch/ab_cold.py $R/D_$r.json 1,2 4,8 nvfp4 > $R/D_$r.log 2>&1; echo "D $r: $(sum $R/D_$r.log)"
  KVFUSE_NATIVE_CUDA_FLAGS="$W8" timeout 60 python3 .scratch/ab_cold.py $R/W8_$r.json 1 4,8 nvfp4 > $R/W8_$r.log 2>&1; echo "W8 $r: $(sum $R/W8_$r.log)"
done
KVFUSE_NATIVE_CUDA_FLAGS="$W8" timeout 150 python3 -m pytest -q -m gpu tests/ops/test_native_attention.py -k NVFP4 -n 8 -p no:cacheprovider > $R/t_attn_W8.log 2>&1; echo "W8 attention NVFP4: $(tail -1 $R/t_attn_W8.log)"
grep -E "^(FAILED|ERROR)" $R/t_attn_W8.log | head -5
echo "done at ${SECONDS}s"
tar czf $OUT/call6.tgz -C $R . && rm -rf $R
