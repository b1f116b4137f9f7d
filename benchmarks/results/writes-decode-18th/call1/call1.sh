set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=4
R=$OUT/r; mkdir -p $R; cp .scratch/call1.sh .scratch/ab_write.py $R/
SECONDS=0
declare -A FL
FL[A]=""
FL[B]="-DKVFUSE_NVFP4_NAN_BRANCH=1"
FL[C]="-DKVFUSE_NVFP4_NAN_BRANCH=1 -DKVFUSE_NVFP4_HW_SCALE=1"
FL[D]="-DKVFUSE_NVFP4_NAN_BRANCH=1 -DKVFUSE_NVFP4_HW_SCALE=1 -DKVFUSE_NVFP4_WORD_WIDEN=1"
FL[E]="-DKVFUSE_NVFP4_NAN_BRANCH=1 -DKVFUSE_NVFP4_HW_SCALE=1 -DKVFUSE_NVFP4_WORD_WIDEN=1 -DKVFUSE_WRITE_PDL=1 -DKVFUSE_DECODE_PDL=1"
for v in A B C D E; do
  KVFUSE_NATIVE_CUDA_FLAGS="${FL[$v]}" python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build $v:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build' &
done
wait
echo "builds at ${SECONDS}s"
KVFUSE_NATIVE_CUDA_FLAGS="${FL[E]}" timeout 150 python3 -m pytest -q -m gpu -n 8 tests/ops/test_native.py -p no:cacheprovider --tb=short > $R/gpu_tests_E.log 2>&1
echo "pytest E rc=$? at ${SECONDS}s"; tail -1 $R/gpu_tests_E.log; grep -E "^(FAILED|ERROR)" $R/gpu_tests_E.log | head -8
for r in 1 2; do for v in A B C D E; do
  KVFUSE_NATIVE_CUDA_FLAGS="${FL[$v]}" timeout 60 python3 .scratch/ab_write.py $R/w_${v}_$r.json nvfp4,fp8_e4m3 16384,65536 > $R/w_${v}_$r.log 2>&1 || echo "w $v failed"
  echo "w $v$r: $(python3 -c "import json; print(' '.join(f\"{x['format'][:5]}{x['tokens']}={x['us']}/{x['pct_copy']}\" for x in json.load(open('$R/w_${v}_$r.json'))))" 2>/dev/null)"
done; done
echo "at ${SECONDS}s"
for v in A E; do
  KVFUSE_NATIVE_CUDA_FLAGS="${FL[$v]}" AB_GRAPH_CALLS=8 timeout 60 python3 .scratch/ab_write.py $R/w8_${v}.json nvfp4,fp8_e4m3 16384 > $R/w8_${v}.log 2>&1 || echo "w8 $v failed"
  echo "w8 $v: $(python3 -c "import json; print(' '.join(f\"{x['format'][:5]}{x['tokens']}={x['us']}/{x['pct_copy']}\" for x in json.load(open('$R/w8_${v}.json'))))" 2>/dev/null)"
done
for r in 1 2; do for v in A E; do
  KVFUSE_NATIVE_CUDA_FLAGS="${FL[$v]}" timeout 40 python3 .scratch/ab_nvfp4.py $R/d_${v}_$r.json 1 4 > $R/d_${v}_$r.log 2>&1 || echo "d $v failed"
  echo "d $v$r: $(grep -o '"mode": "[a-z0-9]*".*"us": [0-9.]*' $R/d_${v}_$r.log | sed 's/"mode": //;s/"batch": //;s/"context": //;s/"splits": //;s/"us": //' | tr '\n' ' ')"
done; done
echo "done at ${SECONDS}s"
tar czf $OUT/call1.tgz -C $R . && rm -rf $R
