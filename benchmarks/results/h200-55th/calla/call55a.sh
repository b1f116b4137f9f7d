# Issue 17, 55th session call a. Builds: h (HEAD f9d9ba6), e1 (KVFUSE_ROPE_NARROW_EXACT=1: FP8
# rotary writes in 8-element single units, decode sizes, take the one-product division for
# power-of-two scales), e2 (=2: also one NaN branch per unit), e3 (e2 at 2 blocks per SM: no
# register budget to speak of). FP8 at 64-1023 tokens, 3 rounds; bf16 and NVFP4 at 64 on h; then
# the unit-pair and FP8-division GPU tests on e2 (HEAD's host tidies and e2's kernels).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r55a; mkdir -p $R; cp .scratch/call55a.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call55a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/base && git archive HEAD | tar -x -C /tmp/base
declare -A DIR=( [h]=/tmp/base [e1]=$ROOT [e2]=$ROOT [e3]=$ROOT )
declare -A FLAGS=( [h]="" [e1]="-DKVFUSE_ROPE_NARROW_EXACT=1" [e2]="-DKVFUSE_ROPE_NARROW_EXACT=2" [e3]="-DKVFUSE_ROPE_NARROW_EXACT=2 -DKVFUSE_ROPE_FP8_NARROW_MIN_BLOCKS=2" )
run() { local v=$1; shift; (cd ${DIR[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${DIR[$v]} "$@"); }
for v in h e1 e2 e3; do run $v python3 $ROOT/.scratch/s55/build.py $v > $R/build_$v.log 2>&1 & done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
bench() { local g=$1 v=$2 r=$3 fm=$4 tk=$5; local d=$R/$g/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --quick --out $d --tokens $tk --formats $fm --variants "$VV" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "$g $v $r ${SECONDS}s"; }
for r in 1 2 3; do for v in h e1 e2 e3; do bench fp8 $v $r fp8 64,256,512,1023; done; done; save
for r in 1 2 3; do bench d64 h $r nvfp4,bfloat16 64; done; save
for g in fp8 d64; do python3 .scratch/s55/summarize.py $R/$g > $R/${g}_summary.txt; cat $R/${g}_summary.txt; done
run e2 timeout 200 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "unit_pairs or every_division" > $R/pytest_e2.txt 2>&1; echo "pytest e2 rc=$? ${SECONDS}s"; tail -n 2 $R/pytest_e2.txt
save; echo "done ${SECONDS}s"
