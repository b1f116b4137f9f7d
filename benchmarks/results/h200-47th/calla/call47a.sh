# Issue 17: FP8 unit pairs holding key and value pairs in one thread prefetch too (q: KVFUSE_ROPE_PREFETCH=2)
# against the tree (t, b6ab41e: unpaired launches only); FP8 at 2560-4096 tokens, two rounds; then q's FP8
# unit-pair GPU tests.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r47a; mkdir -p $R; cp .scratch/call47a.sh $R/; git diff HEAD > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call47a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [q]="-DKVFUSE_ROPE_PREFETCH=2" )
for v in t q; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 40 python3 -m benchmarks.rope_write --quick --out $d --tokens 2560,3072,4096 --formats fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t 1; bench q 1; bench q 2; bench t 2; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
run q timeout 60 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "unit_pairs and e4m3 or unit_pairs and e5m2" > $R/tests.txt 2>&1; echo "tests rc=$? ${SECONDS}s"; tail -2 $R/tests.txt
save; echo "done ${SECONDS}s"
