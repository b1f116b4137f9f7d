# Issue 17: indices before the dependent-launch wait in unpaired launches only, unit pairs included (e, the tree's default),
# e with small FP8 rotary writes in 128-thread blocks (e128) or in 16-element units (e16), against d (no index-first); then
# the GPU tests of e.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=4
R=/tmp/r; mkdir -p $R; cp .scratch/call43b.sh $R/; git diff HEAD -- csrc > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call43b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [d]="-DKVFUSE_WRITE_INDEX_BEFORE_WAIT=0" [e]="" [e128]="-DKVFUSE_ROPE_FP8_NARROW_THREADS=128" [e16]="-DKVFUSE_ROPE_FP8_NARROW_BELOW=0" )
declare -A TREE=( [d]=$PWD [e]=$PWD [e128]=$PWD [e16]=$PWD )
for v in d e e128 e16; do
  (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} "$@"); }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 64,256,4096,16384 --formats fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench d 1; bench e 1; bench e128 1; bench e16 1; save
bench e16 2; bench e128 2; bench e 2; bench d 2; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
bench e128 3; bench d 3; bench e16 3; bench e 3
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_e PYTHONPATH=/tmp/site:$PWD timeout $((570-SECONDS)) python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py tests/ops/test_native.py > $R/tests_e.log 2>&1; echo "tests e rc=$? ${SECONDS}s"; tail -n 3 $R/tests_e.log
save; echo "done ${SECONDS}s"
