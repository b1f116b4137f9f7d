set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=8
R=$OUT/r; mkdir -p $R; cp .scratch/call9.sh .scratch/ab_nvfp4.py $R/
SECONDS=0
OLD="-DKVFUSE_DECODE_NVFP4_HEADS=1"
KVFUSE_NATIVE_CUDA_FLAGS="$OLD" python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build heads1:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build' &
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build'
wait
echo "builds at ${SECONDS}s"
timeout 180 python3 -m pytest -q -m gpu -n 8 tests/ops/test_native_attention.py -p no:cacheprovider --tb=short > $R/gpu_tests.log 2>&1
echo "pytest rc=$? at ${SECONDS}s"; tail -1 $R/gpu_tests.log; grep -E "^(FAILED|ERROR)" $R/gpu_tests.log | head -8
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 \
  --kernel-name kns=decode_attention python3 tests/ops/_native_attention_sanitize.py > $R/sanitizer_attention.log 2>&1
echo "memcheck rc=$? at ${SECONDS}s: $(tail -2 $R/sanitizer_attention.log | tr '\n' ' ')"
timeout 250 python3 -m benchmarks.attention --only decode --decode-cases 64:4096,16:16384 --modes bf16,fp8,nvfp4 \
  --impls kvfuse,kvfuse_native,flashinfer,flashinfer_tc,torch_sdpa --rounds 2 --out $R/dec > $R/dec.log 2>&1
echo "bench rc=$? at ${SECONDS}s"
grep -E '^\| decode \| (fp8|nvfp4)' $R/dec/attention.md | cut -c1-110
for v in new heads1; do
  F=""; [ $v = heads1 ] && F="$OLD"
  KVFUSE_NATIVE_CUDA_FLAGS="$F" timeout 40 python3 .scratch/ab_nvfp4.py $R/b128_$v.json 1 1 fp8,nvfp4 128:4096 > $R/b128_$v.log 2>&1 || echo "b128 $v failed"
  echo "b128 $v: $(grep -o '"mode": "[a-z0-9]*".*"us": [0-9.]*' $R/b128_$v.log | tr '\n' ' ')"
done
left=$((590 - SECONDS))
timeout $left python3 -m pytest -q -m gpu -n 8 tests/models tests/compile tests/integrations tests/ops/test_per_token_head.py -p no:cacheprovider --tb=short > $R/gpu_models.log 2>&1
echo "models rc=$? at ${SECONDS}s"; tail -1 $R/gpu_models.log; grep -E "^(FAILED|ERROR)" $R/gpu_models.log | head -5
tar czf $OUT/call9.tgz -C $R . && rm -rf $R
