# Issue 17 on the H200: split-halves placement of unpaired rotary launches (KVFUSE_ROPE_SPLIT_HALVES),
# against the old order and a build that runs 16384 tokens unpaired too; then the rotary GPU tests.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=5 BENCH_COMMIT=$(cat .scratch/commit)
R=/tmp/r; mkdir -p $R; cp .scratch/call34a.sh $R/
SECONDS=0
save() { tar czf $OUT/call34a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [split]="" [old]="-DKVFUSE_ROPE_SPLIT_HALVES=0" [unp8k]="-DKVFUSE_ROPE_UNPAIRED_BELOW=8192" )
for v in split old unp8k; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
export PYTHONPATH=/tmp/site:$PWD
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" "$@"; }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native)"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 1024,4096,16384 --formats nvfp4,fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; }
bench split 1; bench old 1; bench unp8k 1; echo "round 1 ${SECONDS}s"; save
bench old 2; bench unp8k 2; bench split 2; echo "round 2 ${SECONDS}s"; save
bench unp8k 3; bench split 3; bench old 3; echo "round 3 ${SECONDS}s"; save
grep -h "differ" $R/*/log.txt | sort | uniq -c | head -4
python3 .scratch/summarize26.py $R 2>/dev/null
[ $SECONDS -lt 300 ] && {
run split env KVFUSE_FAILURE_LOG=$R/failures.txt timeout $((560 - SECONDS)) python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu -n 14 -rfE \
  tests/ops/test_rope_kv_write.py tests/ops/test_rope_rotation.py > $R/tests.log 2>&1
echo "pytest rc=$? ${SECONDS}s"; tail -n 3 $R/tests.log; }
save; echo "done ${SECONDS}s"
