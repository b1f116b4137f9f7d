set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=4
R=$OUT/r; mkdir -p $R /tmp/head; cp .scratch/call29c.sh $R/; tar xf .scratch/head_tree.tar -C /tmp/head
SECONDS=0
nvidia-smi --query-gpu=name,uuid --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [head]="" [desc]="" [dp8]="-DKVFUSE_PREFILL_FP8_POLY_EXP2_EVERY=8" [dp4]="-DKVFUSE_PREFILL_FP8_POLY_EXP2_EVERY=4" )
declare -A TREE=( [head]=/tmp/head [desc]=$PWD [dp8]=$PWD [dp4]=$PWD )
V="head desc dp8 dp4"
for v in $V; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]}:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 2 $R/build_*.log; echo "builds ${SECONDS}s"
for round in 1 2; do
  for v in $V; do
    KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]}:$PWD timeout 100 python3 .scratch/ab_prefill.py $v $([ $v = head -o $v = desc ] && echo fp8,bf16 || echo fp8) >> $R/ab.jsonl 2>>$R/ab_err_$v.log
  done
  echo "round $round ${SECONDS}s"
done
python3 - $R/ab.jsonl <<'PY'
import json,sys,collections
d=collections.defaultdict(list)
for l in open(sys.argv[1]):
    r=json.loads(l); d[(r["mode"],r["case"],r["label"])].append(r["us"])
for k in sorted(d): print(*k, d[k])
PY
export PYTHONPATH=/tmp/site:$PWD
for v in dp4 dp8; do
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" timeout 60 python3 .scratch/promote_probe.py $v > $R/probe_$v.jsonl 2>$R/probe_err_$v.log; echo "probe $v rc=$? ${SECONDS}s"
python3 - $R/probe_$v.jsonl <<'PY'
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); print(r["label"], r["seq"], r["kind"], "max", r["max_abs"], "mean_abs", r["mean_abs"], "rel", r["mean_signed_rel"], "last", r["last_rows_signed_rel"])
PY
[ $SECONDS -gt 480 ] && break
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" KVFUSE_FAILURE_LOG=$R/failures_$v.txt timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu -n 12 tests/ops/test_native_prefill.py > $R/tests_$v.log 2>&1; echo "tests $v rc=$? $(tail -n 1 $R/tests_$v.log) ${SECONDS}s"; grep -h "^E  \|^===" $R/failures_$v.txt 2>/dev/null | head -8
done
tar czf $OUT/call29c.tgz -C $R . && rm -rf $R
