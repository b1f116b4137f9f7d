# Issue 16 on the H200: ping-pong barrier ids as immediates (KVFUSE_PREFILL_TURN_IMMEDIATE=1) against the
# default, bf16 and fp8; then the kernel times inside one FP8 / bf16 prefill call (gather vs attention).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r; mkdir -p $R; cp .scratch/call36b.sh .scratch/s36/profile_gather.py $R/; git diff HEAD -- csrc > $R/turn.patch
SECONDS=0
save() { tar czf $OUT/call36b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [base]="" [imm]="-DKVFUSE_PREFILL_TURN_IMMEDIATE=1" )
for v in base imm; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
export PYTHONPATH=/tmp/site:$PWD
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" "$@"; }
ab() { run $1 timeout 60 python3 .scratch/ab_prefill.py $1 $2 >> $R/ab.jsonl 2>>$R/ab_err.log || echo "ab $1 $2 rc=$?"; echo "ab $1 $2 ${SECONDS}s"; }
ab base fp8; ab imm fp8; ab base bf16; ab imm bf16; ab imm fp8; ab base fp8; ab base fp8; ab imm fp8; ab imm bf16; ab base bf16; ab base fp8; ab imm fp8
save
python3 - $R/ab.jsonl <<'PY' | tee $R/ab_summary.txt
import json, sys, collections
d = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); d[(r["case"], r["mode"], r["label"])].append(r["us"])
for k, v in sorted(d.items()): print(k, v)
PY
run base timeout 120 python3 .scratch/s36/profile_gather.py $R/profile.json > $R/profile.log 2>&1; echo "profile rc=$? ${SECONDS}s"; cat $R/profile.log | cut -c1-400
[ $SECONDS -lt 450 ] && run imm env KVFUSE_FAILURE_LOG=$R/failures.txt timeout $((575-SECONDS)) python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/ops/test_native_prefill.py > $R/tests_imm.log 2>&1; echo "imm tests rc=$? $(tail -n 1 $R/tests_imm.log) ${SECONDS}s"
save; echo "done ${SECONDS}s"
