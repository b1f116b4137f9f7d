# Issue 16 on the H200: e4m3 S as two m64n64 commit groups (KVFUSE_PREFILL_FP8_SPLIT_SCORES 1: row maxima of
# keys 0..63 while 64..127 run; 2: their exponentials too) against the default; then GPU prefill tests on 2.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=5
R=/tmp/r; mkdir -p $R; cp .scratch/call36a.sh $R/; git diff HEAD -- csrc > $R/split.patch
SECONDS=0
save() { tar czf $OUT/call36a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [base]="" [s1]="-DKVFUSE_PREFILL_FP8_SPLIT_SCORES=1" [s2]="-DKVFUSE_PREFILL_FP8_SPLIT_SCORES=2" )
for v in base s1 s2; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
export PYTHONPATH=/tmp/site:$PWD
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" "$@"; }
ab() { run $1 timeout 60 python3 .scratch/ab_prefill.py $1 $2 >> $R/ab.jsonl 2>>$R/ab_err.log || echo "ab $1 $2 rc=$?"; echo "ab $1 $2 ${SECONDS}s"; }
ab base fp8; ab s1 fp8; ab s2 fp8; ab base bf16; ab s2 fp8; ab s1 fp8; ab base fp8; ab s2 fp8; ab base fp8
save
python3 - $R/ab.jsonl <<'PY' | tee $R/ab_summary.txt
import json, sys, collections
d = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); d[(r["case"], r["mode"], r["label"])].append(r["us"])
for k, v in sorted(d.items()): print(k, v)
PY
[ $SECONDS -lt 470 ] && run s2 env KVFUSE_FAILURE_LOG=$R/failures.txt timeout $((575-SECONDS)) python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/ops/test_native_prefill.py > $R/tests_s2.log 2>&1; echo "s2 tests rc=$? $(tail -n 1 $R/tests_s2.log) ${SECONDS}s"
save; echo "done ${SECONDS}s"
