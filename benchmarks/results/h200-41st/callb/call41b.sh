# Issue 16: the e4m3 two-level loop with S first and one P buffer: P V of the previous tile in 2 or 4 commit groups
# (sp2, sp4), the softmax writing each part of P once its part of the product is done, against HEAD's loop (head).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=4
R=/tmp/r; mkdir -p $R; cp .scratch/call41b.sh $R/; git diff HEAD -- csrc > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call41b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [head]="" [sp2]="-DKVFUSE_PREFILL_FP8_SPLIT_P=2" [sp4]="-DKVFUSE_PREFILL_FP8_SPLIT_P=4" )
for v in head sp2 sp4; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
run() { v=$1; shift; (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"); }
ab() { run $1 timeout 60 python3 .scratch/ab_prefill.py $1 $2 >> $R/ab.jsonl 2>>$R/ab_err.log || echo "ab $1 $2 rc=$?"; echo "ab $1 $2 ${SECONDS}s"; }
ab head fp8; ab sp2 fp8; ab sp4 fp8; ab head bf16
ab sp4 fp8; ab sp2 fp8; ab head fp8; ab head bf16
ab sp2 fp8; ab head fp8; ab sp4 fp8; ab head bf16
python3 - $R/ab.jsonl <<'PY' | tee $R/ab_summary.txt
import json, sys, collections, statistics
d = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); d[(r["case"], r["mode"], r["label"])].append(r["us"])
for k, v in sorted(d.items()): print(k, v, "median", statistics.median(v))
PY
save
T=$((570-SECONDS)); echo "test budget ${T}s"
if [ $T -gt 60 ]; then
  for v in sp2 sp4; do
    run $v timeout $T python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/ops/test_native_prefill.py > $R/tests_$v.log 2>&1 &
  done
  run sp2 timeout $T python3 .scratch/level_probe.py sp2 > $R/probe_sp2.jsonl 2>$R/probe_sp2.err &
  wait
  for v in sp2 sp4; do echo "tests $v: $(tail -n 1 $R/tests_$v.log)"; grep -E "^FAILED" $R/tests_$v.log | head -8; done
  python3 - $R <<'PY'
import json, sys
for l in open(f"{sys.argv[1]}/probe_sp2.jsonl"):
    r = json.loads(l); print("sp2", r["seq"], r["kind"], r["max_abs"], r["mean_signed_rel"])
PY
fi
save; echo "done ${SECONDS}s"
