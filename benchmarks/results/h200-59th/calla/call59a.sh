# Issue 17, 59th session call a: the benchmark as run_gpu.sh runs it (rope phase,
# ROPE_ROUNDS=15: every variant of rope_write at 64 and 4096 tokens, bf16 / FP8 / NVFP4, FlashInfer
# where it applies), then the GPU tests of the rotary write and of the compile pass.
set -uo pipefail
export PYTHONUNBUFFERED=1
R=/tmp/r59a; mkdir -p $R; cp .scratch/call59a.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0
save() { tar czf $OUT/call59a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
BENCH_COMMIT=$(git rev-parse --short HEAD) ROPE_ROUNDS=15 OUT=$R/gpu timeout 470 bash benchmarks/run_gpu.sh rope > $R/rope_phase.log 2>&1
echo "rope phase rc=$? ${SECONDS}s"; save
left=$((575 - SECONDS))
PYTHONPATH=/tmp/site:$PWD timeout $left python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/compile/test_rope_fusion.py tests/ops/test_rope_kv_write.py > $R/pytest.txt 2>&1
echo "tests rc=$? ${SECONDS}s"; grep -E "passed|failed|error" $R/pytest.txt | tail -2; grep -E "^FAILED|^ERROR" $R/pytest.txt | head -10
save; grep -v "^WARNING" $R/rope_phase.log | cut -c1-230 | tail -40; echo "done ${SECONDS}s"
