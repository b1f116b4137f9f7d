python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm --format=csv > $R/gpu.txt
SECONDS=0
python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('base', i['built'], i['build_seconds'], i['error'])" > $R/build_base.log 2>&1; tail -1 $R/build_base.log; echo "build ${SECONDS}s"
timeout 330 python3 -m benchmarks.attention --only prefill,extend --prefills 4096,16384 --modes bf16,fp8,nvfp4 --impls kvfuse,kvfuse_native,flashinfer,torch_sdpa --rounds 2 --out $R/bench > $R/bench.log 2>&1
echo "bench rc=$? ${SECONDS}s"
timeout 100 python3 .scratch/ab_prefill.py final fp8,bf16 >> $R/ab.jsonl 2>>$R/ab_err.log; cat $R/ab.jsonl
python3 .scratch/table.py $R/bench/attention.json; echo "all ${SECONDS}s"
tar czf $OUT/call23.tgz -C $R . && rm -rf $R
