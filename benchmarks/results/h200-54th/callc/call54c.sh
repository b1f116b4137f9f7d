# Issue 17, 54th session call c: the tree t (FP8 unit-pair rotary writes unpaired below 294912
# items (4608 tokens of 8 x 128); their unpaired launches of more than a wave, prefetching or not
# (ManyWaves), budgeted at 12 blocks over bf16 half tables and 10 over f32 half and full-width
# 16-bit ones; NVFP4 unit pairs paired from 163840 items) against HEAD h (3bea4a7). GPU tests of
# the FP8 and unit-pair rotary writes on t, then FP8 (3 rounds) and NVFP4 (1 round) benchmarks,
# then test_native.py on t.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r54c; mkdir -p $R; cp .scratch/call54c.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call54c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/base && git archive HEAD | tar -x -C /tmp/base
declare -A DIR=( [h]=/tmp/base [t]=$ROOT )
run() { local v=$1; shift; (cd ${DIR[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v PYTHONPATH=/tmp/site:${DIR[$v]} "$@"); }
for v in h t; do run $v python3 $ROOT/.scratch/s54/build.py $v > $R/build_$v.log 2>&1 & done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run t timeout 230 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "unit_pairs or every_division or (native_bit_exact and not nvfp4) or prefill_shapes" > $R/pytest_rope_t.txt 2>&1; echo "pytest rope t rc=$? ${SECONDS}s"; tail -n 2 $R/pytest_rope_t.txt; save
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
bench() { local g=$1 v=$2 r=$3 fm=$4 tk=$5; local d=$R/$g/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --quick --out $d --tokens $tk --formats $fm --variants "$VV" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "$g $v $r ${SECONDS}s"; }
for r in 1 2 3; do for v in h t; do bench fp8 $v $r fp8 64,1024,1100,2048,2560,3072,3584,4096,4608,5120,6144; done; done; save
for v in h t; do bench nv $v 1 nvfp4,bfloat16 4096,5120,6144; done; save
for g in fp8 nv; do python3 .scratch/s54/summarize.py $R/$g > $R/${g}_summary.txt; cat $R/${g}_summary.txt; done
run t timeout 80 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_native.py > $R/pytest_native_t.txt 2>&1; echo "pytest native t rc=$? ${SECONDS}s"; tail -n 2 $R/pytest_native_t.txt
save; echo "done ${SECONDS}s"
