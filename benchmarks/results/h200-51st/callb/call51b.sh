# Issue 17, 51st session call b: FP8 NaN-byte check once per unit (n, the tree) or once per word
# (u: -DKVFUSE_FP8_NAN_CHECK_PER_UNIT=0), against HEAD (h); NVFP4 store copies restored (SASS the
# same as HEAD's, benchmarks.sass_native). p = scales 0.5 / 0.25, o = 0.37 / 0.29. Three rounds.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=6
R=/tmp/r51b; mkdir -p $R; cp .scratch/call51b.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call51b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/base && git archive HEAD | tar -x -C /tmp/base && cp benchmarks/rope_write.py /tmp/base/benchmarks/
declare -A DIR=( [h]=/tmp/base [n]=$PWD [u]=$PWD )
declare -A FLAGS=( [h]="" [n]="" [u]="-DKVFUSE_FP8_NAN_CHECK_PER_UNIT=0" )
for v in h n u; do
  (cd ${DIR[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${DIR[$v]} python3 $ROOT/.scratch/s51/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
bench() { v=$1; sc=$2; r=$3; d=$R/b$v${sc}_$r; mkdir -p $d
  if [ $sc = p ]; then S=0.5,0.25; else S=0.37,0.29; fi
  (cd ${DIR[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${DIR[$v]} timeout 100 python3 -m benchmarks.rope_write --quick --out $d --tokens 2048,4096,16384 --formats fp8 --scales $S --variants "$VV" > $d/log.txt 2>&1) || echo "rope $v$sc rc=$?"
  echo "rope $v$sc $r ${SECONDS}s"; }
for x in "h p" "n p" "u p" "h o" "n o" "u o"; do bench $x 1; done; save
for x in "u o" "n o" "h o" "u p" "n p" "h p"; do bench $x 2; done; save
for x in "n p" "u p" "h p" "n o" "u o" "h o"; do [ $SECONDS -lt 500 ] && bench $x 3; done
python3 .scratch/s51/summarize.py $R > $R/rope_summary.txt
save
cat $R/rope_summary.txt; echo "done ${SECONDS}s"
