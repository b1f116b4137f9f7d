# Issue 16 at 7273653: the whole prefill matrix in one run (Triton kvfuse for speculative decode, native, FlashInfer, SDPA).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$(cat .scratch/commit) MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0
R=/tmp/r; rm -rf $R; mkdir -p $R; cp .scratch/call42d.sh $R/; git log --oneline -1 > $R/commit.txt
save() { tar czf $OUT/call42d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
SECONDS=0
python3 .scratch/s29/build.py head > $R/build.log 2>&1; tail -1 $R/build.log; echo "build ${SECONDS}s"
timeout $((555-SECONDS)) python3 -m benchmarks.attention --only prefill,extend --prefills 4096,16384 --modes bf16,fp8,nvfp4 --impls kvfuse,kvfuse_native,flashinfer,torch_sdpa --rounds 3 --out $R/bench > $R/bench.log 2>&1
echo "bench rc=$? ${SECONDS}s"; save
python3 benchmarks/results/prefill-native-20th/table.py $R/bench/attention.json 2>&1 | tail -34
save; echo "done ${SECONDS}s"
