set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=4
R=$OUT/r; mkdir -p $R /tmp/head; cp .scratch/call28c.sh $R/; tar xf .scratch/head_tree.tar -C /tmp/head
SECONDS=0
nvidia-smi --query-gpu=name,uuid --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [head]="" [chain]="" [t2]="-DKVFUSE_PREFILL_MAX_TREE=2" [t4]="-DKVFUSE_PREFILL_MAX_TREE=4" )
declare -A TREE=( [head]=/tmp/head [chain]=$PWD [t2]=$PWD [t4]=$PWD )
V="head chain t2 t4"
for v in $V; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]}:$PWD python3 -c "from kvfuse.ops import native; print(native.__file__); i=native.build_info(build=True); print('$v', i['built'], i['build_seconds'], str(i['error'])[:1500])" > $R/build_$v.log 2>&1) &
done
wait; tail -qn 2 $R/build_*.log; echo "builds ${SECONDS}s"
for round in 1 2; do
  for v in $V; do
    KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]}:$PWD timeout 100 python3 .scratch/ab_prefill.py $v fp8,bf16 >> $R/ab.jsonl 2>>$R/ab_err_$v.log
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
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_chain timeout 60 python3 .scratch/promote_probe.py chain > $R/probe.jsonl 2>$R/probe_err.log; echo "probe rc=$? ${SECONDS}s"
python3 - $R/probe.jsonl <<'PY'
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); print(r["label"], r["seq"], r["kind"], "max", r["max_abs"], "mean_abs", r["mean_abs"], "rel", r["mean_signed_rel"], "last", r["last_rows_signed_rel"])
PY
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_chain KVFUSE_FAILURE_LOG=$R/failures.txt timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu -n 12 tests/ops/test_native_prefill.py > $R/tests.log 2>&1; echo "tests rc=$? $(tail -n 1 $R/tests.log) ${SECONDS}s"; grep -h "^E  \|^===" $R/failures.txt 2>/dev/null | head -8
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_chain PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 40 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 --kernel-name kns=prefill_attention python3 tests/ops/_native_prefill_sanitize.py > $R/memcheck.log 2>&1; echo "memcheck rc=$? ${SECONDS}s"; tail -n 1 $R/memcheck.log
tar czf $OUT/call28c.tgz -C $R . && rm -rf $R
