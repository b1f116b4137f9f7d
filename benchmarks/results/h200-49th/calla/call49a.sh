# Issue 17, 49th session call a. Equal-halves fast path for unit pairs over full-width 16-bit tables
# (KVFUSE_ROPE_SAME_HALVES): t = 0 (HEAD's kernels), f = 1 (per lane), v = 2 (warp vote), on FP8 and
# NVFP4 over full-width bf16 tables (the benchmark's tables have equal halves), beside bf16 half tables.
# Then the unit-pair / 16-bit-cache GPU tests (with the new equal-halves test) on f, the new test on v.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=6
R=/tmp/r49a; mkdir -p $R; cp .scratch/call49a.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0
save() { tar czf $OUT/call49a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="-DKVFUSE_ROPE_SAME_HALVES=0" [f]="-DKVFUSE_ROPE_SAME_HALVES=1" [v]="-DKVFUSE_ROPE_SAME_HALVES=2" )
for v in t f v; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s49/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 2048,4096 --formats fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t 1; bench f 1; bench v 1; save
python3 .scratch/s49/summarize.py $R
bench v 2; bench f 2; bench t 2; bench t 3; bench f 3; bench v 3; save
python3 .scratch/s49/summarize.py $R > $R/rope_summary.txt
run v timeout 60 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "equal_halves" > $R/tests_v.txt 2>&1; echo "tests v rc=$? ${SECONDS}s"; tail -n 1 $R/tests_v.txt
save
run f timeout 170 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "16bit_caches or unit_pairs" > $R/tests_f.txt 2>&1; echo "tests f rc=$? ${SECONDS}s"; tail -n 1 $R/tests_f.txt
save
cat $R/rope_summary.txt; echo "done ${SECONDS}s"
