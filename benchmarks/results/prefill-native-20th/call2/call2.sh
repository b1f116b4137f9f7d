python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $R/gpu.txt
python3 -c "from kvfuse.ops import native; print(native.build_info(build=True)['build_seconds'])" 2>&1 | tail -3
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/ops/test_native_prefill.py 2>&1 | tail -30 > $R/tests.log
tail -5 $R/tests.log
timeout 280 python3 -m benchmarks.attention --only prefill,extend --prefills 4096,16384 --modes bf16,fp8,nvfp4 --impls kvfuse,kvfuse_native,flashinfer,torch_sdpa --rounds 2 --out $R/bench > $R/bench.log 2>&1
python3 .scratch/table.py $R/bench/attention.json
tar czf $OUT/call2.tgz -C $R . && rm -rf $R
