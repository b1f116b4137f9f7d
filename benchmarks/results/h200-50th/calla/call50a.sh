# Issue 17, 50th session call a: per-block %globaltimer records (scratch probe, .scratch/s50/add_probe.py,
# KVFUSE_PROBE_BLOCK_TIMES=1) of the native write and the paired rotary writes over full-width bf16,
# bf16 half and float32 half tables, timed as the benchmark times them (CUDA graph replays): where does
# the full-width FP8 kernel's extra time per call go (block bodies, the grid's tail, or between
# launches)? t = the tree without the probe (its benchmark, the same session's reference).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r50a; mkdir -p $R; cp .scratch/call50a.sh .scratch/s50/add_probe.py .scratch/s50/blocktimes.py $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0
save() { tar czf $OUT/call50a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [P]="-DKVFUSE_PROBE_BLOCK_TIMES=1" )
for v in t P; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s50/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; tail -n 30 $R/build_P.log; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
run P timeout 200 python3 .scratch/s50/blocktimes.py $R/probe fp8:4096 nvfp4:4096 bfloat16:4096 fp8:2048 fp8:16384 > $R/probe.log 2>&1; echo "probe rc=$? ${SECONDS}s"
save
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
d=$R/bt_1; mkdir -p $d; run t timeout 90 python3 -m benchmarks.rope_write --quick --out $d --tokens 2048,4096 --formats fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1; echo "rope t rc=$? ${SECONDS}s"
save
python3 .scratch/s50/summarize.py $R
grep -v '^{' $R/probe.log | tail -n 30
echo "done ${SECONDS}s"
