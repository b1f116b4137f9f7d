# Issue 16: per-item marks of the work-item kernel, persistent (pbt) and one item per block (nbt); a late claim
# of the next item (late) against the persistent default (pers) and HEAD's kernel (head).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=4
R=/tmp/r; mkdir -p $R; cp .scratch/call37c.sh .scratch/s37/item_trace.py csrc/cuda/prefill_attention.cu $R/
SECONDS=0
save() { tar czf $OUT/call37c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/headtree/csrc && cp -r kvfuse benchmarks .scratch /tmp/headtree/ && cp -r csrc/* /tmp/headtree/csrc/ && rm -f /tmp/headtree/kvfuse/csrc && ln -s ../csrc /tmp/headtree/kvfuse/csrc && cp .scratch/head_prefill_attention.cu /tmp/headtree/csrc/cuda/prefill_attention.cu
declare -A FLAGS=( [head]="" [pers]="" [late]="-DKVFUSE_PREFILL_CLAIM_LATE=1" [pbt]="-DKVFUSE_PREFILL_BLOCK_TRACE=1" [nbt]="-DKVFUSE_PREFILL_BLOCK_TRACE=1 -DKVFUSE_PREFILL_PERSISTENT=0" )
declare -A TREE=( [head]=/tmp/headtree [pers]=$PWD [late]=$PWD [pbt]=$PWD [nbt]=$PWD )
for v in head pers late pbt nbt; do
  (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
run() { v=$1; shift; (cd ${TREE[$v]} && PYTHONPATH=/tmp/site:${TREE[$v]} KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" "$@"); }
for v in pbt nbt; do run $v timeout 100 python3 .scratch/s37/item_trace.py $R/trace_$v.json $v > $R/trace_$v.log 2>&1; echo "trace $v rc=$? ${SECONDS}s"; done
save
ab() { run $1 timeout 60 python3 .scratch/ab_prefill.py $1 $2 >> $R/ab.jsonl 2>>$R/ab_err.log || echo "ab $1 $2 rc=$?"; echo "ab $1 $2 ${SECONDS}s"; }
ab late fp8; ab head fp8; ab pers fp8; ab late bf16; ab head bf16; ab pers bf16; ab late fp8; ab head fp8; ab pers fp8
python3 - $R/ab.jsonl <<'PY' | tee $R/ab_summary.txt
import json, sys, collections
d = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); d[(r["case"], r["mode"], r["label"])].append(r["us"])
for k, v in sorted(d.items()): print(k, v)
PY
python3 - $R <<'PY'
import json, sys
for v in ("pbt", "nbt"):
    try:
        d = json.load(open(f"{sys.argv[1]}/trace_{v}.json"))
    except Exception as e:
        print(v, e); continue
    for case, r in d.items():
        for c in ("c0", "c1"):
            print(v, case, c, r["event_us"], r[c]["ghz"], json.dumps(r[c]["frac"]), json.dumps(r[c]["med"]))
PY
save; echo "done ${SECONDS}s"
