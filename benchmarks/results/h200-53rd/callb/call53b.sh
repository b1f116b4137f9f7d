# Issue 17, 53rd session call b: t (tree = HEAD's kernels) against lv (KVFUSE_ROPE_NVFP4_LATE_VALUES=1:
# NVFP4 unit pairs hold the value pair in the key pair's thread at every size, 64 registers, value
# rows loaded after the rotation). NVFP4 rotary writes at 2048/3072/4096/16384 tokens, three rounds;
# then lv's GPU unit-pair tests.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r53b; mkdir -p $R; cp .scratch/call53b.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call53b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [lv]="-DKVFUSE_ROPE_NVFP4_LATE_VALUES=1" )
for v in t lv; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$ROOT python3 $ROOT/.scratch/s53/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$ROOT "$@"; }
bench() { v=$1; r=$2; d=$R/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --quick --out $d --tokens 2048,3072,4096,16384 --formats nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "rope $v $r ${SECONDS}s"; }
for v in t lv; do bench $v 1; done; save
for v in lv t; do bench $v 2; done; save
for v in t lv; do bench $v 3; done; save
python3 .scratch/s53/summarize.py $R > $R/rope_summary.txt; save
run lv timeout 240 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "unit_pairs" > $R/pytest_lv.txt 2>&1; echo "pytest lv rc=$? ${SECONDS}s"; tail -n 2 $R/pytest_lv.txt
save; cat $R/rope_summary.txt; echo "done ${SECONDS}s"
