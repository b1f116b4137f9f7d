# The cache-write policy with native FP8 / NVFP4 writes at every size and native casts below 16384 tokens under capture
# too: the rotary write benchmark (whose write row is the op, so its NVFP4 floor is now the native kernel) and the
# GPU tests of test_native.py.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=16
R=/tmp/r; mkdir -p $R; cp .scratch/call43e.sh $R/; git diff HEAD > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call43e.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_t PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py t > $R/build_t.log 2>&1; tail -n1 $R/build_t.log; echo "build ${SECONDS}s"
mkdir -p $R/rope; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_t PYTHONPATH=/tmp/site:$PWD timeout 110 python3 -m benchmarks.rope_write --quick --out $R/rope > $R/rope/log.txt 2>&1; echo "rope rc=$? ${SECONDS}s"; save
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_t PYTHONPATH=/tmp/site:$PWD timeout $((300-SECONDS)) python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_native.py tests/ops/test_triton_cache_write.py > $R/tests.log 2>&1; echo "tests rc=$? ${SECONDS}s"; tail -n 2 $R/tests.log
grep '^|' $R/rope/log.txt | cut -c1-200
save; echo "done ${SECONDS}s"
