set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r; mkdir -p $R; cp .scratch/call32c.sh $R/
SECONDS=0
save() { tar czf $OUT/call32c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [new]="" [one]="-DKVFUSE_PREFILL_FP8_ONE_LEVEL=1" )
for v in new one; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
export PYTHONPATH=/tmp/site:$PWD
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" "$@"; }
for v in new one one new; do run $v timeout 60 python3 .scratch/ab_prefill.py $v fp8 >> $R/ab.jsonl 2>>$R/ab_err.log || echo "ab $v rc=$?"; done
echo "ab ${SECONDS}s"; save
python3 - $R/ab.jsonl <<'PY'
import json, sys, collections
d = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); d[(r["case"], r["label"])].append(r["us"])
for k, v in sorted(d.items()): print(k, v)
PY
# correctness, all at once (timings are done)
T=$((565-SECONDS)); echo "test budget ${T}s"
KVFUSE_FAILURE_LOG=$R/failures_rope.txt run new timeout $T python3 -m pytest -v -p no:cacheprovider -m gpu -n 10 tests/ops/test_rope_kv_write.py tests/ops/test_rope_rotation.py tests/compile/test_rope_fusion.py > $R/tests_rope.log 2>&1 &
P1=$!
KVFUSE_FAILURE_LOG=$R/failures_prefill.txt run one timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/ops/test_native_prefill.py > $R/tests_prefill_one.log 2>&1 &
P2=$!
run one timeout $T python3 .scratch/level_probe.py one > $R/probe_one.jsonl 2>$R/probe_one.err &
P3=$!
run new timeout $T python3 .scratch/level_probe.py new > $R/probe_new.jsonl 2>$R/probe_new.err &
P5=$!
PYTORCH_NO_CUDA_MEMORY_CACHING=1 run new timeout $T compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/ops/_native_sanitize.py rope > $R/memcheck_rope.log 2>&1 &
P4=$!
wait $P2; echo "prefill one rc=$? $(tail -n 1 $R/tests_prefill_one.log) ${SECONDS}s"; save
wait $P3 $P5; echo "probes ${SECONDS}s"; save
python3 - $R <<'PY'
import json, sys
for lab in ("new", "one"):
    for l in open(f"{sys.argv[1]}/probe_{lab}.jsonl"):
        r = json.loads(l); print(lab, r["seq"], r["kind"], r["max_abs"], r["mean_signed_rel"], r["last_rows_signed_rel"])
PY
wait $P1; echo "rope tests rc=$? $(tail -n 1 $R/tests_rope.log) ${SECONDS}s"; grep -c PASSED $R/tests_rope.log; grep -E "FAILED|ERROR" $R/tests_rope.log | head -5; save
wait $P4; echo "memcheck rc=$? $(tail -n 2 $R/memcheck_rope.log | tr '\n' ' ') ${SECONDS}s"
save; echo "done ${SECONDS}s"
