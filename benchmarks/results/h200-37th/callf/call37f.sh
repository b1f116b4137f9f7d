# Issue 16: the tensor-map store of O for the 16-bit kernels only (new: the working tree's default; the e4m3 kernel's SASS
# is HEAD's up to parameter offsets) and for both (f8t), against HEAD's kernel (head); GPU prefill tests of the default.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=5
R=/tmp/r; mkdir -p $R; cp .scratch/call37f.sh $R/; git diff HEAD -- csrc > $R/tma_store.patch 2>/dev/null
SECONDS=0
save() { tar czf $OUT/call37f.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/headtree/csrc && cp -r kvfuse benchmarks .scratch /tmp/headtree/ && cp -r csrc/* /tmp/headtree/csrc/ && rm -f /tmp/headtree/kvfuse/csrc && ln -s ../csrc /tmp/headtree/kvfuse/csrc && cp .scratch/head_prefill_attention.cu /tmp/headtree/csrc/cuda/prefill_attention.cu
declare -A FLAGS=( [head]="" [new]="" [f8t]="-DKVFUSE_PREFILL_FP8_TMA_STORE=1" )
declare -A TREE=( [head]=/tmp/headtree [new]=$PWD [f8t]=$PWD )
for v in head new f8t; do
  (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
run() { v=$1; shift; (cd ${TREE[$v]} && PYTHONPATH=/tmp/site:${TREE[$v]} KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" "$@"); }
ab() { run $1 timeout 60 python3 .scratch/ab_prefill.py $1 $2 >> $R/ab.jsonl 2>>$R/ab_err.log || echo "ab $1 $2 rc=$?"; echo "ab $1 $2 ${SECONDS}s"; }
ab new bf16; ab head bf16; ab new fp8; ab head fp8; ab f8t fp8; ab new bf16; ab head bf16; ab f8t fp8; ab head fp8; ab new fp8; ab head bf16; ab new bf16; ab new fp8; ab f8t fp8
python3 - $R/ab.jsonl <<'PY' | tee $R/ab_summary.txt
import json, sys, collections, statistics
d = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); d[(r["case"], r["mode"], r["label"])].append(r["us"])
for k, v in sorted(d.items()): print(k, v, "median", statistics.median(v))
PY
save
[ $SECONDS -lt 470 ] && run new env KVFUSE_FAILURE_LOG=$R/failures.txt timeout $((575-SECONDS)) python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/ops/test_native_prefill.py > $R/tests_new.log 2>&1; echo "new tests rc=$? $(tail -n 1 $R/tests_new.log) ${SECONDS}s"
save; echo "done ${SECONDS}s"
