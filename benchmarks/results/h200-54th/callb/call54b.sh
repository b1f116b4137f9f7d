# Issue 17, 54th session call b. Builds: h (HEAD 3bea4a7), t (tree: FP8 unit-pair rotary writes
# unpaired below 327680 items (5120 tokens), their unpaired kernels budgeted at 10 blocks
# (KVFUSE_ROPE_PAIR_FP8_UNPAIRED_SMALL_BLOCKS); NVFP4 unit pairs paired from 163840), y (t, FP8
# unpaired below 524288: 5120 and 6144 tokens unpaired too), x (t, unpaired FP8 pairs budgeted at
# 12 blocks: 40 registers, no spills over bf16 half tables, 28-36 B spilled over the others). GPU tests of the native rotary writes
# and test_native.py on t first; then FP8 h/t/y/x at 1024-6144 tokens, two rounds.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r54b; mkdir -p $R; cp .scratch/call54b.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call54b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/base && git archive HEAD | tar -x -C /tmp/base
declare -A DIR=( [h]=/tmp/base [t]=$ROOT [y]=$ROOT [x]=$ROOT )
declare -A FLAGS=( [h]="" [t]="" [y]="-DKVFUSE_ROPE_FP8_UNPAIRED_BELOW_ITEMS=524288" [x]="-DKVFUSE_ROPE_PAIR_FP8_UNPAIRED_SMALL_BLOCKS=12" )
run() { local v=$1; shift; (cd ${DIR[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${DIR[$v]} "$@"); }
for v in h t y x; do run $v python3 $ROOT/.scratch/s54/build.py $v > $R/build_$v.log 2>&1 & done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run t timeout 200 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "unit_pairs or every_division or neox_partners or prefill_shapes or shapes_and_pages or special_values" > $R/pytest_rope_t.txt 2>&1; echo "pytest rope t rc=$? ${SECONDS}s"; tail -n 2 $R/pytest_rope_t.txt; save
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
bench() { local g=$1 v=$2 r=$3 fm=$4 tk=$5; local d=$R/$g/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --quick --out $d --tokens $tk --formats $fm --variants "$VV" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "$g $v $r ${SECONDS}s"; }
for r in 1 2; do for v in h t y x; do bench fp8 $v $r fp8 1024,2048,2560,3072,3584,4096,4608,5120,6144; done; done; save
python3 .scratch/s54/summarize.py $R/fp8 > $R/fp8_summary.txt; cat $R/fp8_summary.txt
run t timeout 100 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_native.py > $R/pytest_native_t.txt 2>&1; echo "pytest native t rc=$? ${SECONDS}s"; tail -n 2 $R/pytest_native_t.txt
save; echo "done ${SECONDS}s"
