# H200 baseline of the rotary write (issue 17) and two launch variants at 4096 tokens.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=6 BENCH_COMMIT=$(cat .scratch/commit)
R=/tmp/r; mkdir -p $R; cp .scratch/call33b.sh $R/
SECONDS=0
save() { tar czf $OUT/call33b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [new]="" [unp]="-DKVFUSE_ROPE_UNPAIRED_BELOW=256" [single]="-DKVFUSE_ROPE_NVFP4_PAIRS_FROM=1073741824" )
for v in new unp single; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
export PYTHONPATH=/tmp/site:$PWD
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" "$@"; }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native)"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 45 python3 -m benchmarks.rope_write --quick --out $d --tokens 4096,16384 --formats nvfp4,fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; }
bench new 1; bench unp 1; bench single 1; echo "round 1 ${SECONDS}s"; save
bench single 2; bench unp 2; bench new 2; echo "round 2 ${SECONDS}s"; save
[ $SECONDS -lt 420 ] && { bench new 3; bench unp 3; echo "round 3 ${SECONDS}s"; }
grep -h "differ" $R/*/log.txt | sort | uniq -c | head -4
python3 .scratch/summarize26.py $R 2>/dev/null
save; echo "done ${SECONDS}s"
