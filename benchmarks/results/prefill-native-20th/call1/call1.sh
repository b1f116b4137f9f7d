set -x
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $R/gpu.txt
timeout 240 python3 .scratch/pf_probe.py 2>&1 | tail -40 | tee $R/probe.log
if grep -q "max err 0.0[0-4]" $R/probe.log && ! grep -q "bad rows" $R/probe.log; then
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_native_prefill.py 2>&1 | tail -25 | tee $R/tests.log
  timeout 200 python3 -m benchmarks.attention --only prefill,extend --prefills 4096,16384 --modes bf16,nvfp4 --impls kvfuse,kvfuse_native,flashinfer,torch_sdpa --rounds 2 --out $R/bench 2>&1 | grep -v "^{" | tail -40
fi
tar czf $OUT/call1.tgz -C $R . && rm -rf $R
