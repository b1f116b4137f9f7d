# Issue 17, 51st session call a: the FP8 encode's one-product division for power-of-two scales
# (Division::kExact), two-convert packing (KVFUSE_FP8_PACK_ASM) and NVFP4's single store path,
# against HEAD (h: git archive HEAD, the tree's benchmarks/rope_write.py for --scales).
# p = scales 0.5 / 0.25 (the benchmark's default: powers of two), o = 0.37 / 0.29.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r51a; mkdir -p $R; cp .scratch/call51a.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call51a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/base && git archive HEAD | tar -x -C /tmp/base && cp benchmarks/rope_write.py /tmp/base/benchmarks/
declare -A DIR=( [h]=/tmp/base [n]=$PWD )
for v in h n; do
  (cd ${DIR[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v PYTHONPATH=/tmp/site:${DIR[$v]} python3 $ROOT/.scratch/s51/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
bench() { v=$1; sc=$2; r=$3; d=$R/b$v${sc}_$r; mkdir -p $d
  if [ $sc = p ]; then S=0.5,0.25; F=fp8,nvfp4; else S=0.37,0.29; F=fp8; fi
  (cd ${DIR[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v PYTHONPATH=/tmp/site:${DIR[$v]} timeout 100 python3 -m benchmarks.rope_write --quick --out $d --tokens 2048,4096,16384 --formats $F --scales $S --variants "$VV" > $d/log.txt 2>&1) || echo "rope $v$sc rc=$?"
  echo "rope $v$sc $r ${SECONDS}s"; }
bench h p 1; bench n p 1; bench h o 1; bench n o 1; save
python3 .scratch/s51/summarize.py $R
for x in "n p" "h p" "n o" "h o"; do [ $SECONDS -lt 470 ] && bench $x 2; done; save
python3 .scratch/s51/summarize.py $R > $R/rope_summary.txt
save
cat $R/rope_summary.txt; echo "done ${SECONDS}s"
