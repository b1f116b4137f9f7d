# Issue 17, 49th session call c. Paired unit-pair launches (key and value rows in one thread; FP8
# from 163840 pair items, 16-bit caches at 4099 tokens) load their table columns before the rows
# today. r = rows first where the tables are full-width 16-bit (KVFUSE_SCRATCH_PAIRED_ROWS_FIRST=1),
# s = rows first for every table form (=2), against t (HEAD's kernels). Call b found that dropping
# the upper columns' loads took FP8 at 4096 tokens from 8.46 to 8.28 us while not widening them
# changed nothing.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=6
R=/tmp/r49c; mkdir -p $R; cp .scratch/call49c.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0
save() { tar czf $OUT/call49c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [r]="-DKVFUSE_SCRATCH_PAIRED_ROWS_FIRST=1" [s]="-DKVFUSE_SCRATCH_PAIRED_ROWS_FIRST=2" )
for v in t r s; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s49/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 3072,4096,16384 --formats bfloat16,fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t 1; bench r 1; bench s 1; save
python3 .scratch/s49/summarize.py $R
bench s 2; bench r 2; bench t 2; bench t 3; bench r 3; bench s 3; save
python3 .scratch/s49/summarize.py $R > $R/rope_summary.txt
save
save
cat $R/rope_summary.txt; echo "done ${SECONDS}s"
