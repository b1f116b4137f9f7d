# Next session: the overlap with two-level accumulation (fp8_overlap_pair_products.patch), 1- and 2-tile products,
# against the default; speed (fp8 + bf16 for the ratio), accuracy probe, the positional + constant-value tests.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=6
R=/tmp/r; mkdir -p $R; cp .scratch/call33a.sh $R/
SECONDS=0
save() { tar czf $OUT/call33a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/ov && tar --exclude=./.whl -cf - . | tar -xf - -C /tmp/ov && (cd /tmp/ov && git apply benchmarks/results/prefill-native-32nd/fp8_overlap_pair_products.patch); grep -c "FP8_OVERLAP" /tmp/ov/csrc/cuda/prefill_attention.cu
declare -A FLAGS=( [new]="" [ov1]="-DKVFUSE_PREFILL_FP8_OVERLAP=1" [ov2]="-DKVFUSE_PREFILL_FP8_OVERLAP=2" )
declare -A TREE=( [new]=$PWD [ov1]=/tmp/ov [ov2]=/tmp/ov )
for v in new ov1 ov2; do
  (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
run() { v=$1; shift; (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} "$@"); }
run new timeout 90 python3 .scratch/ab_prefill.py new bf16 >> $R/ab.jsonl 2>>$R/ab_err.log
for v in new ov1 ov2 ov2 ov1 new; do run $v timeout 60 python3 .scratch/ab_prefill.py $v fp8 >> $R/ab.jsonl 2>>$R/ab_err.log || echo "ab $v rc=$?"; done
run new timeout 90 python3 .scratch/ab_prefill.py new bf16 >> $R/ab.jsonl 2>>$R/ab_err.log
echo "ab ${SECONDS}s"; save
python3 - $R/ab.jsonl <<'PY'
import json, sys, collections
d = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); d[(r["case"], r["mode"], r["label"])].append(r["us"])
for k, v in sorted(d.items()): print(k, v)
PY
for v in ov1 ov2; do run $v timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/ops/test_native_prefill.py -k "position_dependent or constant_values or within_the_stated" > $R/tests_$v.log 2>&1; echo "$v tests rc=$? $(tail -n 1 $R/tests_$v.log) ${SECONDS}s"; done; save
[ $SECONDS -lt 430 ] && run ov2 timeout $((560-SECONDS)) python3 .scratch/level_probe.py ov2 > $R/probe_ov2.jsonl 2>$R/probe_ov2.err; echo "probe ${SECONDS}s"
save; echo "done ${SECONDS}s"
