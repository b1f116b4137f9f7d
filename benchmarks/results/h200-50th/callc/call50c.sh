# Issue 17, 50th session call c: what in the full-width bf16 table lengthens the FP8 pair's blocks?
# Timing probes on float32 half tables (.scratch/s50/add_mimic.py): A = 32 opaque integer ops per
# pair where the rotation reads the columns (as many as the full-width widening adds), B = two more
# 16-byte loads per pair held in 8 registers (as the upper columns are), AB = both; t = the tree.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=4
R=/tmp/r50c; mkdir -p $R; cp .scratch/call50c.sh .scratch/s50/add_mimic.py $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0
save() { tar czf $OUT/call50c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [A]="-DKVFUSE_SCRATCH_MIMIC_ALU=1" [B]="-DKVFUSE_SCRATCH_MIMIC_LOADS=1" [AB]="-DKVFUSE_SCRATCH_MIMIC_ALU=1 -DKVFUSE_SCRATCH_MIMIC_LOADS=1" )
for v in t A B AB; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s50/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native);rope_k+write (native), f32 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 4096,16384 --formats fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t 1; bench A 1; bench B 1; bench AB 1; save
python3 .scratch/s50/summarize.py $R
bench AB 2; bench B 2; bench A 2; bench t 2; bench t 3; bench A 3; bench B 3; bench AB 3; save
python3 .scratch/s50/summarize.py $R > $R/rope_summary.txt
save
cat $R/rope_summary.txt; echo "done ${SECONDS}s"
