# Issue 16: the e4m3 consumers without ping-pong turns (npp) re-measured on the H200 against HEAD.
# Issue 17: 128-thread small blocks (t128, same unpaired thresholds in units) for the write and rotary write.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=5
R=/tmp/r; mkdir -p $R; cp .scratch/call39b.sh $R/
SECONDS=0
save() { tar czf $OUT/call39b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [head]="" [npp]="-DKVFUSE_PREFILL_FP8_PINGPONG=0" [t128]="-DKVFUSE_SMALL_THREADS=128 -DKVFUSE_UNPAIRED_BELOW=2048" )
for v in head npp t128; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
run() { v=$1; shift; (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"); }
VV="write;rope_k+write (native), f32 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 80 python3 -m benchmarks.rope_write --quick --out $d --tokens 64,4096,16384 --formats nvfp4,fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; }
bench head 1; bench t128 1; bench t128 2; bench head 2; bench head 3; bench t128 3; echo "rope ${SECONDS}s"; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
ab() { run $1 timeout 60 python3 .scratch/ab_prefill.py $1 $2 >> $R/ab.jsonl 2>>$R/ab_err.log || echo "ab $1 $2 rc=$?"; echo "ab $1 $2 ${SECONDS}s"; }
ab head fp8; ab npp fp8; ab head bf16; ab npp fp8; ab head fp8; ab head fp8; ab npp fp8; ab head bf16
python3 - $R/ab.jsonl <<'PY' | tee $R/ab_summary.txt
import json, sys, collections, statistics
d = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); d[(r["case"], r["mode"], r["label"])].append(r["us"])
for k, v in sorted(d.items()): print(k, v, "median", statistics.median(v))
PY
save
[ $SECONDS -lt 430 ] && run t128 timeout $((560-SECONDS)) python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "unit_pairs or bit_exact or prefill_shapes" > $R/tests_t128.log 2>&1; echo "tests t128 rc=$? ${SECONDS}s"; tail -n 2 $R/tests_t128.log
save; echo "done ${SECONDS}s"
