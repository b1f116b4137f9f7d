# Issue 16: the working tree's default build (tensor-map store of O in the 16-bit kernels): compute-sanitizer memcheck
# over the prefill cases, and benchmarks.attention's prefill rows (kvfuse native, torch SDPA) at 4096 / 16384.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=12 PYTHONPATH=/tmp/site:$PWD
R=/tmp/r; mkdir -p $R; cp .scratch/call37g.sh $R/
SECONDS=0
save() { tar czf $OUT/call37g.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
python3 .scratch/s29/build.py new > $R/build.log 2>&1; tail -1 $R/build.log; echo "build ${SECONDS}s"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 --kernel-name kns=prefill_attention python3 tests/ops/_native_prefill_sanitize.py > $R/memcheck.log 2>&1; echo "memcheck rc=$? ${SECONDS}s"; tail -n 2 $R/memcheck.log
save
timeout $((250-SECONDS)) python3 -m benchmarks.attention --only prefill --prefills 4096,16384 --modes bf16,fp8 --impls kvfuse_native,torch_sdpa --rounds 2 --out $R/bench > $R/bench.log 2>&1; echo "bench rc=$? ${SECONDS}s"
tail -n 25 $R/bench/attention.md 2>/dev/null
save; echo "done ${SECONDS}s"
