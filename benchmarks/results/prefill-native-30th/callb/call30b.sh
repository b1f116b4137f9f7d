set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=4
R=/tmp/r; mkdir -p $R; cp .scratch/call30b.sh $R/
SECONDS=0
save() { tar czf $OUT/call30b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [head]="" [tree]="-DKVFUSE_PREFILL_MAX_TREE=1"
  [f16e4]="-DKVFUSE_PREFILL_FP8_TC_ROWSUM_POLY_F16=1 -DKVFUSE_PREFILL_FP8_TC_ROWSUM_POLY_EXP2_EVERY=4"
  [f16e2]="-DKVFUSE_PREFILL_FP8_TC_ROWSUM_POLY_F16=1 -DKVFUSE_PREFILL_FP8_TC_ROWSUM_POLY_EXP2_EVERY=2" )
V="head tree f16e4 f16e2"
for v in $V; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
nvcc -arch=sm_90a -O3 -o /tmp/mufu_bench .scratch/s30/mufu_bench.cu && /tmp/mufu_bench | tee $R/mufu_bench.txt
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
export PYTHONPATH=/tmp/site:$PWD
for round in 1 2; do
  for v in $V; do
    KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" timeout 60 python3 .scratch/ab_prefill.py $v $([ $v = head ] && echo fp8,bf16 || echo fp8) >> $R/ab.jsonl 2>>$R/ab_err.log || echo "ab $v rc=$?"
  done
  echo "round $round ${SECONDS}s"; save
done
python3 - $R/ab.jsonl <<'PY'
import json,sys,collections
d=collections.defaultdict(list)
for l in open(sys.argv[1]):
    r=json.loads(l); d[(r["mode"],r["case"],r["label"])].append(r["us"])
for k in sorted(d): print(*k, d[k])
PY
for v in f16e2 f16e4; do
  KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" timeout 40 python3 .scratch/promote_probe.py $v > $R/probe_$v.jsonl 2>>$R/ab_err.log; echo "probe $v rc=$? ${SECONDS}s"
  python3 - $R/probe_$v.jsonl <<'PY'
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l)
    if r["seq"] == 8300: print(r["label"], r["seq"], r["kind"], "max", r["max_abs"], "mean_abs", r["mean_abs"], "rel", r["mean_signed_rel"], "last", r["last_rows_signed_rel"])
PY
  [ $SECONDS -gt 420 ] && break
done
save
export KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_head KVFUSE_NATIVE_CUDA_FLAGS=
[ $SECONDS -lt 470 ] && source .scratch/s30/rope_ncu.sh
rm -f $R/*.ncu-rep; save; echo "done ${SECONDS}s"
