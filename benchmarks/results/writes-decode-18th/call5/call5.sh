set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=8
R=$OUT/r; mkdir -p $R; cp .scratch/call5.sh $R/
SECONDS=0
declare -A FL
FL[A]=""
FL[H4]="-DKVFUSE_DECODE_NVFP4_HEADS=4"
FL[N0]="-DKVFUSE_DECODE_NVFP4_PREFETCH=0 -DKVFUSE_DECODE_FP8_PREFETCH=0"
for v in A H4 N0; do
  KVFUSE_NATIVE_CUDA_FLAGS="${FL[$v]}" python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build $v:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build' &
done
wait
echo "builds at ${SECONDS}s"
for r in 1 2; do for v in A H4 N0; do
  S64="1,2"; S16="4,8"; [ $v = H4 ] && S64="1,2" && S16="8,16"; [ $v = N0 ] && S64="1" && S16="4"
  KVFUSE_NATIVE_CUDA_FLAGS="${FL[$v]}" timeout 60 python3 .scratch/ab_nvfp4.py $R/d_${v}_$r.json $S64 $S16 > $R/d_${v}_$r.log 2>&1 || echo "d $v failed"
  echo "d $v$r: $(grep -o '"mode": "[a-z0-9]*".*"us": [0-9.]*' $R/d_${v}_$r.log | sed 's/"mode": //;s/"batch": //;s/"context": //;s/"splits": //;s/"us": //;s/"//g' | tr '\n' ' ')"
done; done
echo "done at ${SECONDS}s"
tar czf $OUT/call5.tgz -C $R . && rm -rf $R
