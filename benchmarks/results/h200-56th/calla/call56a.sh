# Issue 17, 56th session call a. Builds: h (the tree: HEAD c2cd615 + interleaved timing; the value
# rows apart switched off, so h's kernels are HEAD's), va (value rows launched apart, after the
# keys, through the write alone's kernels, from 4096 units = 64 tokens of 8 x 128), p0 (FP8 unit
# pairs at every size). Interleaved rope_write (--rounds 15): all formats at 64 and 4096 tokens, h
# and va, two processes each; FP8 at 16-64 tokens, h and p0. Then HEAD's untested GPU cases.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r56a; mkdir -p $R; cp .scratch/call56a.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call56a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [h]="" [va]="-DKVFUSE_ROPE_VALUES_APART_FROM=4096" [p0]="-DKVFUSE_ROPE_PAIRS_FROM=0" )
run() { local v=$1; shift; (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$ROOT "$@"); }
for v in h va p0; do run $v python3 $ROOT/.scratch/s56/build.py $v > $R/build_$v.log 2>&1 & done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
bench() { local g=$1 v=$2 r=$3 fm=$4 tk=$5; local d=$R/$g/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --rounds 15 --out $d --tokens $tk --formats $fm --variants "$VV" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "$g $v $r ${SECONDS}s"; }
for r in 1 2; do for v in h va; do bench main $v $r bfloat16,fp8,nvfp4 64,4096; done; done; save
for r in 1 2; do for v in h p0; do bench small $v $r fp8 16,32,64; done; done; save
for g in main small; do python3 .scratch/s56/summarize.py $R/$g > $R/${g}_summary.txt; done
run h timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_benchmarks_common.py > $R/pytest_common.txt 2>&1; echo "pytest common rc=$? ${SECONDS}s"; tail -n 1 $R/pytest_common.txt
left=$((545 - SECONDS)); if [ $left -gt 40 ]; then run h timeout $left python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "unit_pairs or neox_partners or every_division" > $R/pytest_h.txt 2>&1; echo "pytest h rc=$? ${SECONDS}s"; tail -n 2 $R/pytest_h.txt; fi
save
for g in main small; do cat $R/${g}_summary.txt; done
echo "done ${SECONDS}s"
