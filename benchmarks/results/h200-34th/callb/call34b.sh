# Issue 16 on the H200: the e4m3 loop with S issued first (KVFUSE_PREFILL_FP8_SCORES_FIRST=1) against the
# default; fp8 + bf16 times, the native prefill GPU tests and the accuracy probe on the new build.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r; mkdir -p $R; cp .scratch/call34b.sh $R/
SECONDS=0
save() { tar czf $OUT/call34b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [new]="" [sf]="-DKVFUSE_PREFILL_FP8_SCORES_FIRST=1" )
for v in new sf; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
export PYTHONPATH=/tmp/site:$PWD
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" "$@"; }
run new timeout 90 python3 .scratch/ab_prefill.py new bf16 >> $R/ab.jsonl 2>>$R/ab_err.log
for v in new sf sf new new sf; do run $v timeout 60 python3 .scratch/ab_prefill.py $v fp8 >> $R/ab.jsonl 2>>$R/ab_err.log || echo "ab $v rc=$?"; echo "ab $v ${SECONDS}s"; done
run new timeout 90 python3 .scratch/ab_prefill.py new bf16 >> $R/ab.jsonl 2>>$R/ab_err.log
echo "ab ${SECONDS}s"; save
python3 - $R/ab.jsonl <<'PY' | tee $R/ab_summary.txt
import json, sys, collections
d = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); d[(r["case"], r["mode"], r["label"])].append(r["us"])
for k, v in sorted(d.items()): print(k, v)
PY
run sf env KVFUSE_FAILURE_LOG=$R/failures.txt timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/ops/test_native_prefill.py > $R/tests_sf.log 2>&1; echo "sf tests rc=$? $(tail -n 1 $R/tests_sf.log) ${SECONDS}s"; save
[ $SECONDS -lt 440 ] && run sf timeout $((560-SECONDS)) python3 .scratch/level_probe.py sf > $R/probe_sf.jsonl 2>$R/probe_sf.err; echo "probe ${SECONDS}s"
save; echo "done ${SECONDS}s"
