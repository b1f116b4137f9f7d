set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r; mkdir -p $R; cp .scratch/call30c.sh $R/
SECONDS=0
save() { tar czf $OUT/call30c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [head]="" [tree]="-DKVFUSE_PREFILL_FP8_MAX_TREE=1" )
V="head tree"
for v in $V; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
export PYTHONPATH=/tmp/site:$PWD
for round in 1 2 3 4; do
  for v in $([ $((round % 2)) = 1 ] && echo "head tree" || echo "tree head"); do
    KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" timeout 60 python3 .scratch/ab_prefill.py $v $([ $v = head -a $round = 1 ] && echo fp8,bf16 || echo fp8) >> $R/ab.jsonl 2>>$R/ab_err.log || echo "ab $v rc=$?"
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
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_tree KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[tree]}" timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -n 12 tests/ops/test_native_prefill.py > $R/tests_tree.log 2>&1; echo "tests tree rc=$? $(tail -n 1 $R/tests_tree.log) ${SECONDS}s"
save; echo "done ${SECONDS}s"
