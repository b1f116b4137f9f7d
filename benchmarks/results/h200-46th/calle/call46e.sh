# Issue 17: the tree (FP8 unit pairs hold the value pair in the key pair's thread from 196608 pair items, 3072
# tokens of 8 x 128) against v (from 163840: 2560 tokens); FP8 at 2048-3072 tokens, three rounds; then the GPU
# tests of the rotary write and the native kernels on the tree.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/re; mkdir -p $R; cp .scratch/call46e.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse --short HEAD > $R/commit.txt
SECONDS=0
save() { tar czf $OUT/call46e.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [v]="-DKVFUSE_ROPE_FP8_UNPAIRED_BELOW_ITEMS=163840" )
for v in t v; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 80 python3 -m benchmarks.rope_write --quick --out $d --tokens 2048,2560,3072 --formats fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t 1; bench v 1; bench v 2; bench t 2; bench t 3; bench v 3; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
run t timeout 300 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py tests/ops/test_native.py > $R/tests.txt 2>&1; echo "tests rc=$? ${SECONDS}s"; tail -3 $R/tests.txt
save; echo "done ${SECONDS}s"
