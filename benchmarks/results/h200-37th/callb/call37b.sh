# Issue 16: the persistent prefill kernel (dynamic work items, turns carried across items) against the
# HEAD kernel (tree copy in /tmp/headtree) and the new code non-persistent; then the GPU prefill tests.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=6
R=/tmp/r; mkdir -p $R; cp .scratch/call37b.sh $R/; git diff HEAD -- csrc > $R/persistent.patch 2>/dev/null || cp csrc/cuda/prefill_attention.cu $R/
SECONDS=0
save() { tar czf $OUT/call37b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/headtree/csrc && cp -r kvfuse benchmarks .scratch /tmp/headtree/ && cp -r csrc/* /tmp/headtree/csrc/ && rm -f /tmp/headtree/kvfuse/csrc && ln -s ../csrc /tmp/headtree/kvfuse/csrc && cp .scratch/head_prefill_attention.cu /tmp/headtree/csrc/cuda/prefill_attention.cu
declare -A FLAGS=( [head]="" [pers]="" [np]="-DKVFUSE_PREFILL_PERSISTENT=0" )
declare -A TREE=( [head]=/tmp/headtree [pers]=$PWD [np]=$PWD )
for v in head pers np; do
  (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
run() { v=$1; shift; (cd ${TREE[$v]} && PYTHONPATH=/tmp/site:${TREE[$v]} KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" "$@"); }
ab() { run $1 timeout 60 python3 .scratch/ab_prefill.py $1 $2 >> $R/ab.jsonl 2>>$R/ab_err.log || echo "ab $1 $2 rc=$?"; echo "ab $1 $2 ${SECONDS}s"; }
ab pers fp8; tail -3 $R/ab.jsonl; tail -5 $R/ab_err.log
ab head fp8; ab head bf16; ab pers bf16; ab np fp8; ab np bf16; ab head fp8; ab pers fp8; ab pers bf16; ab head bf16; ab pers fp8; ab head fp8
python3 - $R/ab.jsonl <<'PY' | tee $R/ab_summary.txt
import json, sys, collections
d = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); d[(r["case"], r["mode"], r["label"])].append(r["us"])
for k, v in sorted(d.items()): print(k, v)
PY
save
[ $SECONDS -lt 470 ] && run pers env KVFUSE_FAILURE_LOG=$R/failures.txt timeout $((575-SECONDS)) python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/ops/test_native_prefill.py > $R/tests_pers.log 2>&1; echo "pers tests rc=$? $(tail -n 1 $R/tests_pers.log) ${SECONDS}s"
save; echo "done ${SECONDS}s"
