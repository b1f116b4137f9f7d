# Issue 16 on the H200: with the warpgroup index broadcast (KVFUSE_PREFILL_UNIFORM_WARPGROUP=1), the e4m3
# kernel's polynomial share (every 4th / 8th / 16th group, none) and a fourth ring stage, re-measured.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=4
R=/tmp/r; mkdir -p $R; cp .scratch/call35d.sh $R/; git diff HEAD -- csrc > $R/uniform.patch
SECONDS=0
save() { tar czf $OUT/call35d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
U="-DKVFUSE_PREFILL_UNIFORM_WARPGROUP=1"
declare -A FLAGS=( [uni]="$U" [e0]="$U -DKVFUSE_PREFILL_FP8_TC_ROWSUM_POLY_EXP2_EVERY=0" [e16]="$U -DKVFUSE_PREFILL_FP8_TC_ROWSUM_POLY_EXP2_EVERY=16" [e4]="$U -DKVFUSE_PREFILL_FP8_TC_ROWSUM_POLY_EXP2_EVERY=4" [s4]="$U -DKVFUSE_PREFILL_FP8_STAGES=4" )
for v in uni e0 e16 e4 s4; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
export PYTHONPATH=/tmp/site:$PWD
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" "$@"; }
ab() { run $1 timeout 60 python3 .scratch/ab_prefill.py $1 $2 >> $R/ab.jsonl 2>>$R/ab_err.log || echo "ab $1 $2 rc=$?"; echo "ab $1 $2 ${SECONDS}s"; }
ab uni bf16; ab uni fp8; ab e0 fp8; ab e16 fp8; ab e4 fp8; ab s4 fp8; ab s4 fp8; ab e4 fp8; ab e16 fp8; ab e0 fp8; ab uni fp8; ab uni bf16
save
python3 - $R/ab.jsonl <<'PY' | tee $R/ab_summary.txt
import json, sys, collections
d = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); d[(r["case"], r["mode"], r["label"])].append(r["us"])
for k, v in sorted(d.items()): print(k, v)
PY
save; echo "done ${SECONDS}s"
