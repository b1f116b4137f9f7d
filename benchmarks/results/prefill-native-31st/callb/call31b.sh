set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=4
R=/tmp/r; mkdir -p $R; cp .scratch/call31b.sh $R/
SECONDS=0
save() { tar czf $OUT/call31b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [unf]="-DKVFUSE_PREFILL_FP8_FUSED_ROWSUM=0" [tc0u]="-DKVFUSE_PREFILL_FP8_TC_ROWSUM_FROM=0 -DKVFUSE_PREFILL_FP8_FUSED_ROWSUM=0"
  [tc0]="-DKVFUSE_PREFILL_FP8_TC_ROWSUM_FROM=0" [tc0p4]="-DKVFUSE_PREFILL_FP8_TC_ROWSUM_FROM=0 -DKVFUSE_PREFILL_FP8_TC_ROWSUM_POLY_EXP2_EVERY=4" )
V="unf tc0u tc0 tc0p4"
for v in $V; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
export PYTHONPATH=/tmp/site:$PWD
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" "$@"; }
for round in 1 2 3 4 5 6; do
  for v in $([ $((round % 2)) = 1 ] && echo "unf tc0u tc0 tc0p4" || echo "tc0p4 tc0 tc0u unf"); do
    run $v timeout 60 python3 .scratch/ab_prefill.py $v $([ $v = unf -a $round -le 2 ] && echo fp8,bf16 || echo fp8) >> $R/ab.jsonl 2>>$R/ab_err.log || echo "ab $v rc=$?"
  done
  echo "round $round ${SECONDS}s"; save
  [ $SECONDS -gt 330 ] && break
done
python3 - $R/ab.jsonl <<'PY'
import json,sys,collections,statistics
d=collections.defaultdict(list)
for l in open(sys.argv[1]):
    r=json.loads(l); d[(r["mode"],r["case"],r["label"])].append(r["us"])
for k in sorted(d): print(*k, d[k], "median", statistics.median(d[k]))
PY
for v in tc0u tc0p4; do
  run $v timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu -n 12 tests/ops/test_native_prefill.py > $R/tests_$v.log 2>&1
  echo "tests $v rc=$? $(tail -n 1 $R/tests_$v.log) ${SECONDS}s"
  [ $SECONDS -gt 440 ] && break
done
save
for v in tc0 tc0u; do
  [ $SECONDS -gt 520 ] && break
  run $v timeout 50 python3 .scratch/promote_probe.py $v > $R/probe_$v.jsonl 2>>$R/ab_err.log; echo "probe $v rc=$? ${SECONDS}s"
done
cat $R/probe_*.jsonl | python3 -c '
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r["label"], r["seq"], r["kind"], "mean_abs", r["mean_abs"], "rel", r["mean_signed_rel"])'
save; echo "done ${SECONDS}s"
