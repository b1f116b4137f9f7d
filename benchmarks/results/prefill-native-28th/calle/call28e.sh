set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=5
R=$OUT/r; mkdir -p $R; cp .scratch/call28e.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [serial]="" [ps]="-DKVFUSE_PREFILL_FP8_P_IN_SMEM=1" [ps0]="-DKVFUSE_PREFILL_FP8_P_IN_SMEM=1 -DKVFUSE_PREFILL_FP8_PINGPONG=0" )
V="serial ps ps0"
for v in $V; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('$v', i['built'], i['build_seconds'], str(i['error'])[:1500])" > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"
for v in ps ps0; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" KVFUSE_FAILURE_LOG=$R/failures_$v.txt timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -n 6 tests/ops/test_native_prefill.py > $R/tests_$v.log 2>&1; echo "tests $v rc=$? $(tail -n 1 $R/tests_$v.log)" > $R/tests_$v.rc) &
done
wait; cat $R/tests_*.rc; echo "tests ${SECONDS}s"; grep -h "^E  \|^===" $R/failures_*.txt 2>/dev/null | head -10
for round in 1 2; do
  for v in $V; do
    m=fp8; [ $round = 1 ] && [ $v = serial ] && m=fp8,bf16
    KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" timeout 60 python3 .scratch/ab_prefill.py $v $m >> $R/ab.jsonl 2>>$R/ab_err_$v.log
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
for v in ps ps0; do
  KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" timeout 40 python3 .scratch/promote_probe.py $v >> $R/probe.jsonl 2>$R/probe_err_$v.log; echo "probe $v rc=$? ${SECONDS}s"
done
python3 - $R/probe.jsonl <<'PY'
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l)
    if r["kind"] != "randn" or r["seq"] == 4099: print(r["label"], r["seq"], r["kind"], "max", r["max_abs"], "mean_abs", r["mean_abs"], "rel", r["mean_signed_rel"])
PY
tar czf $OUT/call28e.tgz -C $R . && rm -rf $R
