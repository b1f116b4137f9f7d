# Issue 16 on the H200 at HEAD (the uniform warpgroup index on by default): the native prefill GPU tests,
# the prefill matrix with FlashInfer and torch SDPA (3 rounds), and memcheck over the prefill sanitizer cases.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$(cat .scratch/commit) MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0
R=/tmp/r; mkdir -p $R; cp .scratch/call35e.sh $R/
save() { tar czf $OUT/call35e.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.sm,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
SECONDS=0
python3 .scratch/s29/build.py head > $R/build.log 2>&1; tail -1 $R/build.log; echo "build ${SECONDS}s"
KVFUSE_FAILURE_LOG=$R/failures.txt timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu -n 12 tests/ops/test_native_prefill.py > $R/tests_native_prefill.log 2>&1; echo "tests rc=$? $(tail -n 1 $R/tests_native_prefill.log) ${SECONDS}s"; head -c 1500 $R/failures.txt 2>/dev/null
save
timeout 360 python3 -m benchmarks.attention --only prefill,extend --prefills 4096,16384 --modes bf16,fp8,nvfp4 --impls kvfuse_native,flashinfer,torch_sdpa --rounds 3 --out $R/bench > $R/bench.log 2>&1
echo "bench rc=$? ${SECONDS}s"; save
python3 benchmarks/results/prefill-native-20th/table.py $R/bench/attention.json 2>&1 | tail -32
[ $SECONDS -lt 500 ] && { PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 --kernel-name kns=prefill_attention python3 tests/ops/_native_prefill_sanitize.py > $R/memcheck.log 2>&1; echo "memcheck rc=$? ${SECONDS}s"; tail -n 1 $R/memcheck.log; }
save; echo "done ${SECONDS}s"
