# Issue 17: FP8 rotary writes in unit pairs (8-element units and their NeoX partners, one thread each) at every
# size (pf0: KVFUSE_ROPE_PAIRS_FROM=0) against HEAD (single 8-element units below 65536 units), now that
# pairs hand the encode floats and small launches take 128-thread blocks; GPU rotary-write tests of pf0.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r; rm -rf $R; mkdir -p $R; cp .scratch/call40c.sh $R/
SECONDS=0
save() { tar czf $OUT/call40c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [head]="" [pf0]="-DKVFUSE_ROPE_PAIRS_FROM=0" )
for v in head pf0; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
run() { v=$1; shift; (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"); }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 80 python3 -m benchmarks.rope_write --quick --out $d --tokens 64,256,1024,2048,4096 --formats fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench head 1; bench pf0 1; bench pf0 2; bench head 2; bench head 3; bench pf0 3; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
WIN=$(python3 - <<'PY'
import json, glob
def best(b, tok):
    return min(r["rope_k+write (native), f32 half tables"] for f in glob.glob(f"/tmp/r/b{b}_*/rope_write.json") for r in json.load(open(f))["rows"] if r["tokens"] == tok)
print(int(best("pf0", 64) < best("head", 64) - 0.02))
PY
)
echo "pf0 wins at 64: $WIN"
[ "$WIN" = 1 ] && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_pf0 KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[pf0]}" PYTHONPATH=/tmp/site:$PWD timeout $((560-SECONDS)) python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py > $R/tests_pf0.log 2>&1; echo "tests pf0 rc=$? ${SECONDS}s"; tail -n 3 $R/tests_pf0.log
save; echo "done ${SECONDS}s"
