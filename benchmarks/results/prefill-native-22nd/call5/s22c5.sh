python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/s22c5.sh $R/
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm --format=csv > $R/gpu.txt
SECONDS=0
python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('build', i['built'], i['build_seconds'], i['error'])" > $R/build.log 2>&1; tail -1 $R/build.log; echo "build ${SECONDS}s"
timeout 330 python3 -m benchmarks.attention --only prefill,extend --prefills 4096,16384 --modes bf16,fp8,nvfp4 --impls kvfuse,kvfuse_native,flashinfer,torch_sdpa --rounds 2 --out $R/bench > $R/bench.log 2>&1
echo "bench rc=$? ${SECONDS}s"
timeout 60 python3 .scratch/ab_prefill.py final fp8,bf16 >> $R/ab.jsonl 2>>$R/ab_err.log; cat $R/ab.jsonl
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_native_prefill.py > $R/tests_native_prefill.log 2>&1; tail -1 $R/tests_native_prefill.log
timeout 120 python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_quantized_prefill.py "tests/ops/test_rope_kv_write.py::test_op_through_forced_triton" -rfEs > $R/tests_changed_no_mark.log 2>&1; tail -1 $R/tests_changed_no_mark.log
echo "tests ${SECONDS}s"
python3 .scratch/table.py $R/bench/attention.json; echo "all ${SECONDS}s"
tar czf $OUT/s22c5.tgz -C $R . && rm -rf $R
