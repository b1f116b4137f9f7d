# Issue 17, FP8 at 2560-4096 tokens (unit pairs holding key and value pairs in one thread): f, the
# pair kernels over half tables at 48 registers (10 blocks of 128 per SM instead of 9:
# KVFUSE_ROPE_PAIR_FP8_HALF_MIN_BLOCKS=5); p, rows loaded before the table columns
# (KVFUSE_SCRATCH_PAIRED_ROWS_FIRST=1); against the tree t (18d332a). Three rounds, then the FP8
# unit-pair GPU tests on f and p.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=6
R=/tmp/r47e; mkdir -p $R; cp .scratch/call47e.sh $R/; git diff HEAD > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call47e.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [f]="-DKVFUSE_ROPE_PAIR_FP8_HALF_MIN_BLOCKS=5" [p]="-DKVFUSE_SCRATCH_PAIRED_ROWS_FIRST=1" )
for v in t f p; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 40 python3 -m benchmarks.rope_write --quick --out $d --tokens 2560,3072,4096 --formats fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t 1; bench f 1; bench p 1; bench p 2; bench f 2; bench t 2; bench t 3; bench f 3; bench p 3; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
for v in f p; do
  run $v timeout 80 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "unit_pairs and e4m3 or unit_pairs and e5m2" > $R/tests_$v.txt 2>&1; echo "tests $v rc=$? ${SECONDS}s"; tail -1 $R/tests_$v.txt
done
save; echo "done ${SECONDS}s"
