# Issue 17, 53rd session call e: the final tree t (per-format paired thresholds for the writes alone:
# FP8 unpaired below 524288 items, NVFP4 below 163840) against HEAD h. Writes alone and rotary
# writes at 2048-6144 tokens, NVFP4 and FP8, two rounds; then test_native.py's GPU tests on t.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r53e; mkdir -p $R; cp .scratch/call53e.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call53e.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/base && git archive HEAD | tar -x -C /tmp/base
declare -A DIR=( [h]=/tmp/base [t]=$PWD )
for v in h t; do
  (cd ${DIR[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v PYTHONPATH=/tmp/site:${DIR[$v]} python3 $ROOT/.scratch/s53/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
run() { v=$1; shift; (cd ${DIR[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v PYTHONPATH=/tmp/site:${DIR[$v]} "$@"); }
bench() { local v=$1 r=$2; local d=$R/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --quick --out $d --tokens 2048,2560,3072,4096,6144 --formats nvfp4,fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "rope $v $r ${SECONDS}s"; }
bench h 1; bench t 1; bench t 2; bench h 2; save
python3 .scratch/s53/summarize.py $R > $R/rope_summary.txt; save; cat $R/rope_summary.txt
run t timeout 260 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_native.py > $R/pytest_t.txt 2>&1; echo "pytest t rc=$? ${SECONDS}s"; tail -n 3 $R/pytest_t.txt
save; echo "done ${SECONDS}s"
