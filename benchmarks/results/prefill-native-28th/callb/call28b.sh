set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=4
R=$OUT/r; mkdir -p $R; cp .scratch/call28b.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid,clocks.sm,clocks.max.sm --format=csv > $R/gpu.csv; cat $R/gpu.csv
P="-DKVFUSE_PREFILL_FP8_SERIAL=1 -DKVFUSE_PREFILL_FP8_PINGPONG=1"
declare -A FLAGS=( [e4]="" [pp3]="$P" [pp4]="$P -DKVFUSE_PREFILL_FP8_STAGES=4" [pp5]="$P -DKVFUSE_PREFILL_FP8_STAGES=5" [pp3rs]="$P -DKVFUSE_PREFILL_FP8_TC_ROWSUM_FROM=0" )
V="e4 pp3 pp4 pp5 pp3rs"
for v in $V; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('$v', i['built'], i['build_seconds'], str(i['error'])[:1500])" > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"
for round in 1 2 3; do
  for v in $V; do
    m=fp8; [ $round = 1 ] && [ $v = e4 ] && m=fp8,bf16
    KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" timeout 100 python3 .scratch/ab_prefill.py $v $m >> $R/ab.jsonl 2>>$R/ab_err_$v.log
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
tar czf $OUT/call28b.tgz -C $R . && rm -rf $R
