set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 BENCH_COMMIT=5e87a2e FLASHINFER_CUDA_ARCH_LIST=9.0
R=$OUT/res; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 200 python3 -m pytest -q -m gpu -n 8 tests/ops/test_mixed_formats.py tests/ops/test_mixed_attention.py tests/ops/test_rope_kv_write.py -p no:cacheprovider -rfE > $R/gpu_tests.log 2>&1; echo "pytest rc=$?"; grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -15
timeout 150 python3 -m benchmarks.rope_write --out $R > $R/rope.log 2>&1; echo "rope rc=$?"; grep '^|' $R/rope.log | cut -c1-220
timeout 110 python3 -m benchmarks.cache_write --quick --impls kvfuse --out $R > $R/write.log 2>&1; echo "write rc=$?"; grep -E "^(fp8|nvfp4|bfloat|device|NVIDIA)|copy" $R/write.log | grep -E " 16384 | 65536 |copy" | cut -c1-120
timeout 110 python3 -m benchmarks.attention --quick --only decode --impls kvfuse --out $R > $R/attn.log 2>&1; echo "attn rc=$?"; tail -14 $R/attn.log | cut -c1-150
