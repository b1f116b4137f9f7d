set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r; mkdir -p $R; cp .scratch/call32a.sh $R/
SECONDS=0
save() { tar czf $OUT/call32a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [base]="-DKVFUSE_NVFP4_PAIR_STORE=0" [pair]="-DKVFUSE_NVFP4_PAIR_STORE=1" )
for v in base pair; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
export PYTHONPATH=/tmp/site:$PWD
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" "$@"; }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native)"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 40 python3 -m benchmarks.rope_write --quick --out $d --tokens 4096,16384 --formats nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; }
bench base 1; bench pair 1; echo "round 1 ${SECONDS}s"; save
KVFUSE_FAILURE_LOG=$R/failures.txt run pair timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -n 12 --durations=15 tests/ops/test_rope_kv_write.py tests/ops/test_rope_rotation.py tests/compile/test_rope_fusion.py > $R/tests_pair.log 2>&1
echo "tests rc=$? $(tail -n 1 $R/tests_pair.log) ${SECONDS}s"; head -c 1500 $R/failures.txt 2>/dev/null; save
if [ $SECONDS -lt 420 ]; then
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 run pair timeout $((540-SECONDS)) compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/ops/_native_sanitize.py rope > $R/memcheck_pair.log 2>&1
  echo "memcheck rc=$? $(tail -n 2 $R/memcheck_pair.log | tr '\n' ' ') ${SECONDS}s"; save
fi
[ $SECONDS -lt 500 ] && { bench pair 2; bench base 2; echo "round 2 ${SECONDS}s"; }
grep -h "differ" $R/*/log.txt | sort | uniq -c | head -4
python3 .scratch/summarize26.py $R 2>/dev/null
save; echo "done ${SECONDS}s"
