python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=8
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm --format=csv > $R/gpu.txt
SECONDS=0
python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('base', i['built'], i['build_seconds'], i['error'])" > $R/build_base.log 2>&1 &
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_ones KVFUSE_NATIVE_CUDA_FLAGS="-DKVFUSE_PREFILL_FP8_ONES=1" python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('ones', i['built'], i['build_seconds'], i['error'])" > $R/build_ones.log 2>&1 &
wait; cat $R/build_*.log | tail -2; echo "builds ${SECONDS}s"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/ops/test_native_prefill.py > $R/tests_native_prefill.log 2>&1; tail -2 $R/tests_native_prefill.log
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_ones KVFUSE_NATIVE_CUDA_FLAGS="-DKVFUSE_PREFILL_FP8_ONES=1" timeout 60 python3 -m pytest -q -p no:cacheprovider tests/ops/test_native_prefill.py -k "fp8 or sinks" > $R/tests_ones.log 2>&1; tail -1 $R/tests_ones.log
timeout 100 python3 -m pytest -q -p no:cacheprovider -n 8 tests/models tests/compile tests/integrations tests/ops/test_per_token_head.py --deselect tests/compile/test_rope_fusion.py > $R/tests_models.log 2>&1; tail -2 $R/tests_models.log
echo "tests ${SECONDS}s"
for v in base ones; do
  if [ $v = ones ]; then export KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_ones KVFUSE_NATIVE_CUDA_FLAGS="-DKVFUSE_PREFILL_FP8_ONES=1"; fi
  timeout 60 python3 .scratch/ab_prefill.py $v fp8 >> $R/ab.jsonl 2>$R/ab_err_$v.log
done
unset KVFUSE_NATIVE_BUILD_DIR KVFUSE_NATIVE_CUDA_FLAGS
cat $R/ab.jsonl; echo "ab ${SECONDS}s"
timeout 300 python3 -m benchmarks.attention --only prefill,extend --prefills 4096,16384 --modes bf16,fp8,nvfp4 --impls kvfuse,kvfuse_native,flashinfer,torch_sdpa --rounds 2 --out $R/bench > $R/bench.log 2>&1
python3 .scratch/table.py $R/bench/attention.json; echo "bench ${SECONDS}s"
tar czf $OUT/call6.tgz -C $R . && rm -rf $R
