# Issue 16 at 7273653 (f16 scores, overlap, no ping-pong, TMA store for e4m3): A/B against 0370b20's default
# (new: ping-pong on, TMA store off), the native prefill GPU tests, then the prefill matrix with FlashInfer and SDPA.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8 BENCH_COMMIT=$(cat .scratch/commit) FLASHINFER_CUDA_ARCH_LIST=9.0
R=/tmp/r; rm -rf $R; mkdir -p $R; cp .scratch/call42c.sh $R/; git diff HEAD -- csrc > $R/tree.patch; git log --oneline -1 > $R/commit.txt
SECONDS=0
save() { tar czf $OUT/call42c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [def]="" [new]="-DKVFUSE_PREFILL_FP8_PINGPONG=1 -DKVFUSE_PREFILL_FP8_TMA_STORE=0" )
for v in def new; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"); }
ab() { run $1 timeout 60 python3 .scratch/ab_prefill.py $1 $2 >> $R/ab.jsonl 2>>$R/ab_err.log || echo "ab $1 $2 rc=$?"; echo "ab $1 $2 ${SECONDS}s"; }
ab def fp8; ab new fp8; ab def bf16
ab new fp8; ab def fp8; ab def bf16
ab def fp8; ab new fp8; ab def bf16
python3 - $R/ab.jsonl <<'PY' | tee $R/ab_summary.txt
import json, sys, collections, statistics
d = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); d[(r["case"], r["mode"], r["label"])].append(r["us"])
for k, v in sorted(d.items()): print(k, v, "median", statistics.median(v))
PY
save
run def timeout 150 python3 -m pytest -q -m gpu -n 3 -p no:cacheprovider tests/ops/test_native_prefill.py > $R/tests_def.log 2>&1
echo "tests def: $(tail -n 1 $R/tests_def.log) ${SECONDS}s"; grep -E "^FAILED|^E  " $R/tests_def.log | head -12; save
run def timeout $((575-SECONDS)) python3 -m benchmarks.attention --only prefill,extend --prefills 4096,16384 --modes bf16,fp8,nvfp4 --impls kvfuse_native,flashinfer,torch_sdpa --rounds 3 --out $R/bench > $R/bench.log 2>&1
echo "bench rc=$? ${SECONDS}s"; save
run def python3 benchmarks/results/prefill-native-20th/table.py $R/bench/attention.json 2>&1 | tail -24
save; echo "done ${SECONDS}s"
