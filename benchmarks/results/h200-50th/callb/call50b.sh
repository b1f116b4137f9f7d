# Issue 17, 50th session call b: full-width bf16 table columns loaded another way (scratch variants,
# .scratch/s50/add_variants.py): c1 = the upper columns by ld.global.cg, c2 = all columns by .cg,
# s = half-warps load lower / upper columns and swap them by shuffle (benchmark geometry only);
# t = the tree. Three alternating rounds of the rotary write benchmark.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=4
R=/tmp/r50b; mkdir -p $R; cp .scratch/call50b.sh .scratch/s50/add_variants.py $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0
save() { tar czf $OUT/call50b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [c1]="-DKVFUSE_SCRATCH_TABLE_CG=1" [c2]="-DKVFUSE_SCRATCH_TABLE_CG=2" [s]="-DKVFUSE_SCRATCH_SHFL_UPPER=1" )
for v in t c1 c2 s; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s50/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native);rope_k+write (native), f32 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 2048,4096 --formats fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t 1; bench c1 1; bench c2 1; bench s 1; save
python3 .scratch/s50/summarize.py $R
bench s 2; bench c2 2; bench c1 2; bench t 2; bench t 3; bench c1 3; bench c2 3; bench s 3; save
python3 .scratch/s50/summarize.py $R > $R/rope_summary.txt
save
cat $R/rope_summary.txt; echo "done ${SECONDS}s"
