set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=4
R=/tmp/r; mkdir -p $R; cp .scratch/call31a.sh $R/
SECONDS=0
save() { tar czf $OUT/call31a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [unf]="-DKVFUSE_PREFILL_FP8_FUSED_ROWSUM=0" [fus]="" [tc0]="-DKVFUSE_PREFILL_FP8_TC_ROWSUM_FROM=0"
  [u5]="-DKVFUSE_ROPE_PAIR_NVFP4_UNPAIRED_MIN_BLOCKS=5" )
V="unf fus tc0 u5"
for v in $V; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
export PYTHONPATH=/tmp/site:$PWD
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" "$@"; }
for v in fus tc0; do
  run $v timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu -n 12 tests/ops/test_native_prefill.py > $R/tests_$v.log 2>&1
  echo "tests $v rc=$? $(tail -n 1 $R/tests_$v.log) ${SECONDS}s"
done
save
for round in 1 2 3 4; do
  for v in $([ $((round % 2)) = 1 ] && echo "unf fus tc0" || echo "tc0 fus unf"); do
    run $v timeout 60 python3 .scratch/ab_prefill.py $v $([ $v = fus -a $((round % 2)) = 1 ] && echo fp8,bf16 || echo fp8) >> $R/ab.jsonl 2>>$R/ab_err.log || echo "ab $v rc=$?"
  done
  echo "round $round ${SECONDS}s"; save
  [ $SECONDS -gt 340 ] && break
done
python3 - $R/ab.jsonl <<'PY'
import json,sys,collections,statistics
d=collections.defaultdict(list)
for l in open(sys.argv[1]):
    r=json.loads(l); d[(r["mode"],r["case"],r["label"])].append(r["us"])
for k in sorted(d): print(*k, d[k], "median", statistics.median(d[k]))
PY
run fus timeout 50 python3 .scratch/promote_probe.py fus > $R/probe_fus.jsonl 2>>$R/ab_err.log; echo "probe rc=$? ${SECONDS}s"
python3 - $R/probe_fus.jsonl <<'PY'
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); print(r["label"], r["seq"], r["kind"], "mean_abs", r["mean_abs"], "rel", r["mean_signed_rel"])
PY
save
VV="write;rope_k+write (native), f32 half tables"
for v in fus u5; do
  [ $SECONDS -gt 520 ] && break
  d=$R/b${v}_1; mkdir -p $d
  run $v timeout 45 python3 -m benchmarks.rope_write --quick --out $d --tokens 4096,16384 --formats nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "rope $v ${SECONDS}s"
done
python3 .scratch/summarize26.py $R 2>/dev/null
save; echo "done ${SECONDS}s"
