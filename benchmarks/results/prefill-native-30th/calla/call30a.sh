set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=3
R=$OUT/r; mkdir -p $R; cp .scratch/call30a.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid,clocks.max.sm --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [head]="" [tree]="-DKVFUSE_PREFILL_MAX_TREE=1" [f16e8]="-DKVFUSE_PREFILL_FP8_TC_ROWSUM_POLY_F16=1"
  [f16e4]="-DKVFUSE_PREFILL_FP8_TC_ROWSUM_POLY_F16=1 -DKVFUSE_PREFILL_FP8_TC_ROWSUM_POLY_EXP2_EVERY=4"
  [f16e2]="-DKVFUSE_PREFILL_FP8_TC_ROWSUM_POLY_F16=1 -DKVFUSE_PREFILL_FP8_TC_ROWSUM_POLY_EXP2_EVERY=2"
  [f16e4t]="-DKVFUSE_PREFILL_FP8_TC_ROWSUM_POLY_F16=1 -DKVFUSE_PREFILL_FP8_TC_ROWSUM_POLY_EXP2_EVERY=4 -DKVFUSE_PREFILL_MAX_TREE=1" )
V="head tree f16e8 f16e4 f16e2 f16e4t"
for v in $V; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
# meanwhile: MUFU / f16x2 polynomial throughput
nvcc -arch=sm_90a -O3 -o /tmp/mufu_bench .scratch/s30/mufu_bench.cu && /tmp/mufu_bench | tee $R/mufu_bench.txt
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"
export PYTHONPATH=/tmp/site:$PWD
# pipe utilisation of the e4m3 kernel (16384 fresh tokens, tensor-core row sums) and of the bf16 kernel, head build
for m in fp8 bf16; do
  KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_head timeout 90 ncu --section ComputeWorkloadAnalysis --section SpeedOfLight \
    --metrics "regex:sm__pipe_.*cycles_active.avg.pct_of_peak_sustained_active,regex:sm__inst_executed_pipe_.*avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second,gpu__time_duration.sum" \
    --cache-control none --clock-control none -k regex:prefill_attention_kernel --launch-skip 1 --launch-count 1 --csv --page raw \
    python3 .scratch/s29/ncu_prefill.py $m 16384 > $R/pipes_$m.csv 2> $R/pipes_$m.err || echo "ncu $m rc=$?"
done
python3 - $R <<'PY'
import csv, sys, glob
for path in sorted(glob.glob(sys.argv[1] + "/pipes_*.csv")):
    rows = [r for r in csv.reader(open(path)) if r]
    try:
        h = next(i for i, r in enumerate(rows) if "ID" in r[:3])
    except StopIteration:
        print(path, "no data"); continue
    hdr, units, val = rows[h], rows[h + 1], rows[h + 2]
    out = [(k, v) for k, v in zip(hdr, val) if ("pipe" in k or "issue_active" in k or "per_second" in k or "duration" in k) and v not in ("", "0", "n/a")]
    print(path.split("/")[-1], " ".join(f"{k.replace('.avg.pct_of_peak_sustained_active','%')}={v}" for k, v in out if not v.startswith("0.0") ))
PY
echo "ncu ${SECONDS}s"
for round in 1 2; do
  for v in $V; do
    KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v timeout 100 python3 .scratch/ab_prefill.py $v $([ $v = head ] && echo fp8,bf16 || echo fp8) >> $R/ab.jsonl 2>>$R/ab_err_$v.log
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
for v in f16e4 f16e2; do
  [ $SECONDS -gt 500 ] && break
  KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v timeout 40 python3 .scratch/promote_probe.py $v > $R/probe_$v.jsonl 2>$R/probe_err_$v.log; echo "probe $v rc=$? ${SECONDS}s"
  python3 - $R/probe_$v.jsonl <<'PY'
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l)
    if r["seq"] == 8300: print(r["label"], r["seq"], r["kind"], "max", r["max_abs"], "mean_abs", r["mean_abs"], "rel", r["mean_signed_rel"], "last", r["last_rows_signed_rel"])
PY
done
tar czf $OUT/call30a.tgz -C $R . && rm -rf $R
