# Issue 16: block-level marks (KVFUSE_PREFILL_BLOCK_TRACE=1 debug build): gaps between blocks, prologues,
# epilogues and the tail, FP8 e4m3 and bf16 fresh 16384 / 4096; the default build's A/B times beside.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r; mkdir -p $R; cp .scratch/call37a.sh .scratch/s37/block_trace.py $R/; git diff HEAD -- csrc > $R/block_trace.patch
SECONDS=0
save() { tar czf $OUT/call37a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [base]="" [bt]="-DKVFUSE_PREFILL_BLOCK_TRACE=1" )
for v in base bt; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
export PYTHONPATH=/tmp/site:$PWD
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" "$@"; }
run bt timeout 120 python3 .scratch/s37/block_trace.py $R/block_trace.json > $R/block_trace.log 2>&1; echo "trace rc=$? ${SECONDS}s"; cat $R/block_trace.log | tail -8
save
ab() { run $1 timeout 60 python3 .scratch/ab_prefill.py $1 $2 >> $R/ab.jsonl 2>>$R/ab_err.log || echo "ab $1 $2 rc=$?"; echo "ab $1 $2 ${SECONDS}s"; }
ab base fp8; ab base bf16; ab bt fp8; ab bt bf16
python3 - $R/ab.jsonl <<'PY' | tee $R/ab_summary.txt
import json, sys, collections
d = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); d[(r["case"], r["mode"], r["label"])].append(r["us"])
for k, v in sorted(d.items()): print(k, v)
PY
save; echo "done ${SECONDS}s"
