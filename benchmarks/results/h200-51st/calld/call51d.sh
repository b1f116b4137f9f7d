# Issue 17, 51st session call d: the final tree (g: the exact division and the one NaN branch only
# where ptxas spills nothing more than at HEAD; each word's quotients computed just before their
# convert), FP8 only, two rounds at p = scales 0.5 / 0.25 and o = 0.37 / 0.29 (HEAD's numbers: call c);
# then the GPU tests of the rotary and native write files.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=16
R=/tmp/r51d; mkdir -p $R; cp .scratch/call51d.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0
save() { tar czf $OUT/call51d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
export KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_g PYTHONPATH=/tmp/site:$PWD
python3 .scratch/s51/build.py g > $R/build_g.log 2>&1; tail -n 1 $R/build_g.log; echo "build ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "the build failed"; save; exit 1; fi
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables;rope_k+write (native), f32 tables"
bench() { sc=$1; r=$2; d=$R/bg${sc}_$r; mkdir -p $d
  if [ $sc = p ]; then S=0.5,0.25; else S=0.37,0.29; fi
  timeout 100 python3 -m benchmarks.rope_write --quick --out $d --tokens 2048,4096,16384 --formats fp8 --scales $S --variants "$VV" > $d/log.txt 2>&1 || echo "rope $sc rc=$?"
  echo "rope $sc $r ${SECONDS}s"; }
bench p 1; bench o 1; bench o 2; bench p 2
python3 .scratch/s51/summarize.py $R > $R/rope_summary.txt; cat $R/rope_summary.txt; save
left=$((585 - SECONDS))
timeout $left python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py tests/ops/test_native.py > $R/tests.txt 2>&1; echo "tests rc=$? ${SECONDS}s"
grep -E "passed|failed|error" $R/tests.txt | tail -3; grep -E "^FAILED|^ERROR" $R/tests.txt | head -20
save; echo "done ${SECONDS}s"
