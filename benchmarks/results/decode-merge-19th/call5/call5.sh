set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/call5.sh $R/
SECONDS=0
G3="-DKVFUSE_DECODE_NVFP4_GROUP_MIN_BLOCKS=3"
build() { KVFUSE_NATIVE_CUDA_FLAGS="$1" python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build' | sed "s/^/[$2] /"; }
build "" D & build "$G3" G3 & wait
echo "builds at ${SECONDS}s"
sum() { grep -o '"mode".*"us": [0-9.]*' $1 | sed 's/"mode": //;s/"batch": //;s/"context": //;s/"splits": //;s/"us": //;s/"//g' | tr '\n' ' '; }
for r in 1 2 3; do
  timeout 60 python3 .scratch/ab_cold.py $R/Dfp8_$r.json 1 4 fp8 > $R/Dfp8_$r.log 2>&1; echo "D $r: $(sum $R/Dfp8_$r.log)"
  timeout 60 python3 .scratch/ab_cold.py $R/D_$r.json 1 4,6,8 nvfp4 > $R/D_$r.log 2>&1; echo "D $r: $(sum $R/D_$r.log)"
  KVFUSE_NATIVE_CUDA_FLAGS="$G3" timeout 60 python3 .scratch/ab_cold.py $R/G3_$r.json 1 5,6 nvfp4 > $R/G3_$r.log 2>&1; echo "G3 $r: $(sum $R/G3_$r.log)"
done
echo "done at ${SECONDS}s"
tar czf $OUT/call5.tgz -C $R . && rm -rf $R
