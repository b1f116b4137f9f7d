# Issue 17, 52nd session call a: the NVFP4 encode with fewer instructions (t: biased codes + packed
# amax; a: packed amax only, KVFUSE_NVFP4_BIASED_CODES=0) against HEAD (h). NVFP4 only; rotary
# writes at 2048/4096/16384 tokens (two rounds), then the NVFP4 write alone (cache_write).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=5
R=/tmp/r52a; mkdir -p $R; cp .scratch/call52a.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call52a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/base && git archive HEAD | tar -x -C /tmp/base
declare -A DIR=( [h]=/tmp/base [t]=$PWD [a]=$PWD )
declare -A FLAGS=( [h]="" [t]="" [a]="-DKVFUSE_NVFP4_BIASED_CODES=0" )
for v in h t a; do
  (cd ${DIR[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${DIR[$v]} python3 $ROOT/.scratch/s52/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
run() { v=$1; shift; (cd ${DIR[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${DIR[$v]} "$@"); }
bench() { v=$1; r=$2; d=$R/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --quick --out $d --tokens 2048,4096,16384 --formats nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "rope $v $r ${SECONDS}s"; }
for v in h t a; do bench $v 1; done; save
for v in a t h; do bench $v 2; done; save
python3 .scratch/s52/summarize.py $R > $R/rope_summary.txt; cat $R/rope_summary.txt; save
i=0; for v in h t a h t; do i=$((i+1)); d=$R/cw_${v}_$i; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.cache_write --quick --formats nvfp4 --impls kvfuse_native --out $d > $d/log.txt 2>&1 || echo "cw $v rc=$?"
  echo "cw $v ${SECONDS}s"; grep -iE "nvfp4" $d/log.txt | tail -4; done
save; echo "done ${SECONDS}s"
