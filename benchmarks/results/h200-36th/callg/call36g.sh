# Issue 16 on the H200: the e4m3 softmax sums P itself (KVFUSE_PREFILL_FP8_TC_ROWSUMS=0, no m64n8 products), with the
# polynomial share at every 8th (default) or 4th group, against the default; GPU prefill tests on fsum.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=5
R=/tmp/r; mkdir -p $R; cp .scratch/call36g.sh $R/; git diff HEAD -- csrc > $R/fadd_rowsums.patch
SECONDS=0
save() { tar czf $OUT/call36g.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [base]="" [fsum]="-DKVFUSE_PREFILL_FP8_TC_ROWSUMS=0" [fsum4]="-DKVFUSE_PREFILL_FP8_TC_ROWSUMS=0 -DKVFUSE_PREFILL_FP8_TC_ROWSUM_POLY_EXP2_EVERY=4" )
for v in base fsum fsum4; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
export PYTHONPATH=/tmp/site:$PWD
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" "$@"; }
ab() { run $1 timeout 60 python3 .scratch/ab_prefill.py $1 $2 >> $R/ab.jsonl 2>>$R/ab_err.log || echo "ab $1 $2 rc=$?"; echo "ab $1 $2 ${SECONDS}s"; }
ab base fp8; ab fsum fp8; ab fsum4 fp8; ab base bf16; ab fsum4 fp8; ab fsum fp8; ab base fp8; ab fsum fp8
save
python3 - $R/ab.jsonl <<'PY' | tee $R/ab_summary.txt
import json, sys, collections
d = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); d[(r["case"], r["mode"], r["label"])].append(r["us"])
for k, v in sorted(d.items()): print(k, v)
PY
[ $SECONDS -lt 450 ] && run fsum env KVFUSE_FAILURE_LOG=$R/failures.txt timeout $((575-SECONDS)) python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/ops/test_native_prefill.py > $R/tests_fsum.log 2>&1; echo "fsum tests rc=$? $(tail -n 1 $R/tests_fsum.log) ${SECONDS}s"
save; echo "done ${SECONDS}s"
