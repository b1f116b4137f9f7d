# Issue 16 on the H200: sustained 16384-token prefill (back to back, 10 s, SM clock and power sampled) for
# bf16 and e4m3, with the uniform warpgroup index (HEAD's default) and without (KVFUSE_PREFILL_UNIFORM_WARPGROUP=0).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r; mkdir -p $R; cp .scratch/call35f.sh .scratch/clock_probe.py $R/
SECONDS=0
save() { tar czf $OUT/call35f.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [uni]="" [base]="-DKVFUSE_PREFILL_UNIFORM_WARPGROUP=0" )
for v in uni base; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
export PYTHONPATH=/tmp/site:$PWD
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" "$@"; }
for vm in "uni bf16" "uni fp8" "base bf16" "base fp8" "uni fp8" "uni bf16" "base fp8" "base bf16"; do set -- $vm
  run $1 timeout 30 python3 .scratch/clock_probe.py $1 $2 16384 10 >> $R/clock.jsonl 2>>$R/clock.err || echo "clock $1 $2 rc=$?"; echo "clock $1 $2 ${SECONDS}s"; done
cat $R/clock.jsonl; save; echo "done ${SECONDS}s"
