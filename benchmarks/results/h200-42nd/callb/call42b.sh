# Issue 16 at 0370b20 (f16 scores + overlap on): the new default (new) against the old loop (old: both off) and
# four variants of the new one: ping-pong off (np), 2 or 4 K/V stages (s2, s4), O by tensor-map stores (ts);
# then the native prefill GPU tests on the default build.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=3
R=/tmp/r; rm -rf $R; mkdir -p $R; cp .scratch/call42b.sh $R/; git diff HEAD -- csrc > $R/tree.patch; git log --oneline -1 > $R/commit.txt
SECONDS=0
save() { tar czf $OUT/call42b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [new]="" [old]="-DKVFUSE_PREFILL_FP8_SCORES_F16=0 -DKVFUSE_PREFILL_FP8_OVERLAP=0" [np]="-DKVFUSE_PREFILL_FP8_PINGPONG=0" [s2]="-DKVFUSE_PREFILL_FP8_STAGES=2" [s4]="-DKVFUSE_PREFILL_FP8_STAGES=4" [ts]="-DKVFUSE_PREFILL_FP8_TMA_STORE=1" )
for v in new old np s2 s4 ts; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"); }
ab() { run $1 timeout 60 python3 .scratch/ab_prefill.py $1 $2 >> $R/ab.jsonl 2>>$R/ab_err.log || echo "ab $1 $2 rc=$?"; echo "ab $1 $2 ${SECONDS}s"; }
ab new fp8; ab old fp8; ab np fp8; ab s2 fp8; ab s4 fp8; ab ts fp8; ab new bf16
ab ts fp8; ab s4 fp8; ab s2 fp8; ab np fp8; ab old fp8; ab new fp8; ab new bf16
ab s2 fp8; ab new fp8; ab ts fp8; ab old fp8; ab s4 fp8; ab np fp8; ab new bf16
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
  run new timeout $T python3 -m pytest -q -m gpu -n 3 -p no:cacheprovider tests/ops/test_native_prefill.py > $R/tests_new.log 2>&1
  echo "tests new: $(tail -n 1 $R/tests_new.log)"; grep -E "^FAILED|^E  " $R/tests_new.log | head -12
fi
save; echo "done ${SECONDS}s"
