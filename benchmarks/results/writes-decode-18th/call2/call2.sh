set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=4
R=$OUT/r; mkdir -p $R; cp .scratch/call2.sh $R/
SECONDS=0
declare -A FL
FL[A]=""
FL[B]="-DKVFUSE_DECODE_NVFP4_PREFETCH=256"
FL[C]="-DKVFUSE_DECODE_NVFP4_PREFETCH=256 -DKVFUSE_DECODE_FP8_PREFETCH=256"
FL[D]="-DKVFUSE_DECODE_NVFP4_PREFETCH=128"
for v in A B C D; do
  KVFUSE_NATIVE_CUDA_FLAGS="${FL[$v]}" python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build $v:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build' &
done
wait
echo "builds at ${SECONDS}s"
timeout 170 python3 -m pytest -q -m gpu -n 8 tests/ops/test_native.py tests/ops/test_per_token_head.py tests/ops/test_rope_kv_write.py tests/ops/test_rope_rotation.py tests/compile/test_rope_fusion.py -p no:cacheprovider --tb=short > $R/gpu_tests.log 2>&1
echo "pytest rc=$? at ${SECONDS}s"; tail -1 $R/gpu_tests.log; grep -E "^(FAILED|ERROR)" $R/gpu_tests.log | head -8
for r in 1 2; do for v in A B C D; do
  KVFUSE_NATIVE_CUDA_FLAGS="${FL[$v]}" timeout 40 python3 .scratch/ab_nvfp4.py $R/d_${v}_$r.json 1 4 > $R/d_${v}_$r.log 2>&1 || echo "d $v failed"
  echo "d $v$r: $(grep -o '"mode": "[a-z0-9]*".*"us": [0-9.]*' $R/d_${v}_$r.log | sed 's/"mode": //;s/"batch": //;s/"context": //;s/"splits": //;s/"us": //' | tr '\n' ' ')"
done; done
echo "at ${SECONDS}s"
left=$((585 - SECONDS))
timeout $left python3 -m benchmarks.cache_write --quick --formats bfloat16,fp8_e4m3,nvfp4,fp8_per_token_head,fp8_e4m3/nvfp4 --impls kvfuse,kvfuse_native,flashinfer --out $R/cw > $R/cw.log 2>&1
echo "cw rc=$? at ${SECONDS}s"
grep -E "16384|65536" $R/cw/cache_write.md | cut -c1-150 | head -24
tar czf $OUT/call2.tgz -C $R . && rm -rf $R
