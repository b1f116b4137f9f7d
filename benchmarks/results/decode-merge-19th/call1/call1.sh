set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/call1.sh .scratch/ab_cold.py $R/
SECONDS=0
GB="-DKVFUSE_DECODE_NVFP4_HEADS=4 -DKVFUSE_DECODE_NVFP4_GROUP_STAGE=1"
GC="$GB -DKVFUSE_DECODE_NVFP4_STAGES=4"
build() { KVFUSE_NATIVE_CUDA_FLAGS="$1" python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build' | sed "s/^/[$2] /"; }
build "" A & build "$GB" B & build "$GC" C & wait
echo "builds at ${SECONDS}s"
# The default build's tests (device_attributes.h's first GPU run), then the group stage's NVFP4 attention tests.
timeout 120 python3 -m pytest -q -x -m gpu tests/ops/test_native.py -n 8 -p no:cacheprovider > $R/t_native.log 2>&1; echo "A test_native: $(tail -1 $R/t_native.log)"
KVFUSE_NATIVE_CUDA_FLAGS="$GB" timeout 150 python3 -m pytest -q -m gpu tests/ops/test_native_attention.py -k "nvfp4 or NVFP4" -n 8 -p no:cacheprovider > $R/t_attn_B.log 2>&1; echo "B attention nvfp4: $(tail -1 $R/t_attn_B.log)"
echo "tests at ${SECONDS}s"
sum() { grep -o '"batch".*"us": [0-9.]*' $1 | sed 's/"batch": //;s/"context": //;s/"splits": //;s/"us": //' | tr '\n' ' '; }
for r in 1 2; do
  timeout 60 python3 .scratch/ab_cold.py $R/A_$r.json 1 4 fp8,nvfp4 > $R/A_$r.log 2>&1; echo "A $r fp8+nvfp4: $(sum $R/A_$r.log)"
  KVFUSE_NATIVE_CUDA_FLAGS="$GB" timeout 60 python3 .scratch/ab_cold.py $R/B_$r.json 2,4 8,16 nvfp4 > $R/B_$r.log 2>&1; echo "B $r nvfp4: $(sum $R/B_$r.log)"
  KVFUSE_NATIVE_CUDA_FLAGS="$GC" timeout 60 python3 .scratch/ab_cold.py $R/C_$r.json 2 8 nvfp4 > $R/C_$r.log 2>&1; echo "C $r nvfp4: $(sum $R/C_$r.log)"
done
echo "done at ${SECONDS}s"
tar czf $OUT/call1.tgz -C $R . && rm -rf $R
