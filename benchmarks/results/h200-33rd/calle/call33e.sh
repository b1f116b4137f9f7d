# nvidia-h200-x2: issue 18's GPU part (NCCL, NVLink multicast off): the distributed GPU tests, then
# the TP=1 vs TP=2 decode step (--quick, to fit the session's device time).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=30 BENCH_COMMIT=$(cat .scratch/commit)
R=$OUT; cp .scratch/call33e.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv; nvidia-smi topo -m > $R/topo.txt 2>&1
python3 -c "import accelerate, transformers; print('accelerate', accelerate.__version__, 'transformers', transformers.__version__)"
python3 .scratch/s29/build.py head > $R/build.log 2>&1; tail -1 $R/build.log; echo "build ${SECONDS}s"
KVFUSE_FAILURE_LOG=$R/failures.txt timeout 150 python3 -m pytest -v --tb=short -m gpu tests/distributed -p no:cacheprovider -rfE > $R/gpu_tp.log 2>&1
echo "tests rc=$? ${SECONDS}s"; grep -E "PASSED|FAILED|ERROR" $R/gpu_tp.log | tail -8; tail -n 2 $R/gpu_tp.log
timeout $((390-SECONDS)) torchrun --nproc-per-node 2 -m benchmarks.tp_decode_step --quick --out $R > $R/tp_bench.log 2>&1
echo "bench rc=$? ${SECONDS}s"; tail -n 14 $R/tp_bench.log
