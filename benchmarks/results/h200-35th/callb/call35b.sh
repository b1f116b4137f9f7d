# Issue 17 on the H200: NVFP4 rotary writes of 4096 tokens paired (key and value rows in one thread)
# at 3 and at 4 blocks per SM (the latter spills: ptxas 80 / 124 bytes), against the default (unpaired).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=5 BENCH_COMMIT=$(cat .scratch/commit)
R=/tmp/r; mkdir -p $R; cp .scratch/call35b.sh $R/
SECONDS=0
save() { tar czf $OUT/call35b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [base]="" [p3]="-DKVFUSE_ROPE_UNPAIRED_BELOW=256" [p4]="-DKVFUSE_ROPE_UNPAIRED_BELOW=256 -DKVFUSE_ROPE_PAIR_NVFP4_MIN_BLOCKS=4" )
for v in base p3 p4; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
export PYTHONPATH=/tmp/site:$PWD
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" "$@"; }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native)"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 4096,16384 --formats nvfp4,fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; }
bench base 1; bench p3 1; bench p4 1; echo "round 1 ${SECONDS}s"; save
bench p4 2; bench base 2; bench p3 2; echo "round 2 ${SECONDS}s"; save
bench p3 3; bench p4 3; bench base 3; echo "round 3 ${SECONDS}s"; save
grep -h "differ" $R/*/log.txt | sort | uniq -c | head -4
python3 .scratch/summarize26.py $R 2>/dev/null
save; echo "done ${SECONDS}s"
