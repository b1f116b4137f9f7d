# Issue 17, 49th session call b. Timing-only probes (wrong for tables whose halves differ; the
# benchmark's halves are equal): p = the upper table columns loaded, folded into a store that never
# happens, and the lower columns widened once for both chunks; q = the upper columns not loaded at
# all. Against t (HEAD's kernels). Asks whether widening the upper columns is what full-width
# bf16 tables cost over float32 half tables.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=6
R=/tmp/r49b; mkdir -p $R; cp .scratch/call49b.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0
save() { tar czf $OUT/call49b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="-DKVFUSE_ROPE_SAME_HALVES=0" [p]="-DKVFUSE_ROPE_SAME_HALVES=3" [q]="-DKVFUSE_ROPE_SAME_HALVES=4" )
for v in t p q; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s49/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 2048,4096 --formats fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t 1; bench p 1; bench q 1; save
python3 .scratch/s49/summarize.py $R
bench q 2; bench p 2; bench t 2; bench t 3; bench p 3; bench q 3; save
python3 .scratch/s49/summarize.py $R > $R/rope_summary.txt
save
save
cat $R/rope_summary.txt; echo "done ${SECONDS}s"
