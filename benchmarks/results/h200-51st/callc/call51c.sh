# Issue 17, 51st session call c: the tree (m: one NaN branch per FP8 unit except paired launches over
# 16-bit half tables) against HEAD (h), with full float32 tables too (kernels that ptxas now spills).
# p = scales 0.5 / 0.25, o = 0.37 / 0.29. Rounds while time allows.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=6
R=/tmp/r51c; mkdir -p $R; cp .scratch/call51c.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call51c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/base && git archive HEAD | tar -x -C /tmp/base && cp benchmarks/rope_write.py /tmp/base/benchmarks/
declare -A DIR=( [h]=/tmp/base [m]=$PWD )
declare -A FLAGS=( [h]="" [m]="" )
for v in h m; do
  (cd ${DIR[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${DIR[$v]} python3 $ROOT/.scratch/s51/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables;rope_k+write (native), f32 tables"
bench() { v=$1; sc=$2; r=$3; d=$R/b$v${sc}_$r; mkdir -p $d
  if [ $sc = p ]; then S=0.5,0.25; else S=0.37,0.29; fi
  (cd ${DIR[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${DIR[$v]} timeout 100 python3 -m benchmarks.rope_write --quick --out $d --tokens 2048,4096,16384 --formats fp8 --scales $S --variants "$VV" > $d/log.txt 2>&1) || echo "rope $v$sc rc=$?"
  echo "rope $v$sc $r ${SECONDS}s"; }
for x in "h p" "m p" "h o" "m o"; do bench $x 1; done; save
for x in "m o" "h o" "m p" "h p"; do bench $x 2; done; save
for x in "h p" "m p" "h o" "m o"; do [ $SECONDS -lt 480 ] && bench $x 3; done
python3 .scratch/s51/summarize.py $R > $R/rope_summary.txt
save
cat $R/rope_summary.txt; echo "bench done ${SECONDS}s"
left=$((575 - SECONDS))
if [ $left -gt 120 ]; then
  KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_m PYTHONPATH=/tmp/site:$PWD timeout $left python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py tests/ops/test_native.py > $R/tests.txt 2>&1; echo "tests rc=$? ${SECONDS}s"
  grep -E "passed|failed|error" $R/tests.txt | tail -3; grep -E "^FAILED|^ERROR" $R/tests.txt | head -20
fi
save; echo "done ${SECONDS}s"
