# Issue 17, 54th session call a. Builds: h (HEAD 3bea4a7), t (tree: NVFP4 unit-pair rotary writes
# paired from 163840 items, KVFUSE_ROPE_NVFP4_UNPAIRED_BELOW_ITEMS), u (t + FP8 unit-pair rotary
# writes unpaired below 524288 items, i.e. up to 8191 tokens), w (u + KVFUSE_ROPE_PAIR_MIN_BLOCKS=5:
# unpaired FP8 pairs budgeted at 48 registers). GPU tests of test_rope_kv_write.py and
# test_native.py on t first; then FP8 t/u/w at 2560-6144 tokens and NVFP4 h/t at 4096-6144.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r54a; mkdir -p $R; cp .scratch/call54a.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call54a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/base && git archive HEAD | tar -x -C /tmp/base
declare -A DIR=( [h]=/tmp/base [t]=$ROOT [u]=$ROOT [w]=$ROOT )
declare -A FLAGS=( [h]="" [t]="" [u]="-DKVFUSE_ROPE_FP8_UNPAIRED_BELOW_ITEMS=524288" [w]="-DKVFUSE_ROPE_FP8_UNPAIRED_BELOW_ITEMS=524288 -DKVFUSE_ROPE_PAIR_MIN_BLOCKS=5" )
run() { local v=$1; shift; (cd ${DIR[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${DIR[$v]} "$@"); }
for v in h t u w; do run $v python3 $ROOT/.scratch/s54/build.py $v > $R/build_$v.log 2>&1 & done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run t timeout 240 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py tests/ops/test_native.py > $R/pytest_t.txt 2>&1; echo "pytest t rc=$? ${SECONDS}s"; tail -n 3 $R/pytest_t.txt; save
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
bench() { local g=$1 v=$2 r=$3 fm=$4 tk=$5; local d=$R/$g/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --quick --out $d --tokens $tk --formats $fm --variants "$VV" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "$g $v $r ${SECONDS}s"; }
for r in 1 2; do for v in t u w; do bench fp8 $v $r fp8 2560,3072,4096,6144; done; done; save
for r in 1 2; do for v in h t; do bench nv $v $r nvfp4 4096,5120,6144; done; done; save
for g in fp8 nv; do python3 .scratch/s54/summarize.py $R/$g > $R/${g}_summary.txt; cat $R/${g}_summary.txt; done
save; echo "done ${SECONDS}s"
