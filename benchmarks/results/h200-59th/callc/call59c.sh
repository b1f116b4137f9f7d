# Issue 17, 59th session call c: run_gpu.sh's rope phase as committed (ROPE_ROUNDS=15), its
# short table printed last by benchmarks.summary.
set -uo pipefail
R=/tmp/r59c; mkdir -p $R; cp .scratch/call59c.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
BENCH_COMMIT=29f2a7d ROPE_ROUNDS=15 OUT=$R/gpu timeout 285 bash benchmarks/run_gpu.sh rope > $R/rope_phase.log 2>&1
echo "rope phase rc=$? ${SECONDS}s"; tar czf $OUT/call59c.tgz -C $R .; grep -v "^WARNING" $R/rope_phase.log | cut -c1-200 | tail -14
