set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r; mkdir -p $R; cp .scratch/call32d.sh $R/
SECONDS=0
save() { tar czf $OUT/call32d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid --format=csv > $R/gpu.csv; cat $R/gpu.csv
# the one-level experiment in a patched copy of the tree
mkdir -p /tmp/one && tar --exclude=./.whl -cf - . | tar -xf - -C /tmp/one && (cd /tmp/one && (git apply benchmarks/results/prefill-native-32nd/fp8_one_level_and_overlap.patch || patch -p1 < benchmarks/results/prefill-native-32nd/fp8_one_level_and_overlap.patch)); grep -c ONE_LEVEL /tmp/one/csrc/cuda/prefill_attention.cu
(KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_new PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py new > $R/build_new.log 2>&1) &
(cd /tmp/one && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_one KVFUSE_NATIVE_CUDA_FLAGS="-DKVFUSE_PREFILL_FP8_ONE_LEVEL=1" PYTHONPATH=/tmp/site:/tmp/one python3 $OLDPWD/.scratch/s29/build.py one > $R/build_one.log 2>&1) &
wait; tail -qn 2 $R/build_*.log; echo "builds ${SECONDS}s"; save
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_new PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/ops/test_native_prefill.py > $R/tests_prefill_new.log 2>&1 &
P1=$!
(cd /tmp/one && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_one KVFUSE_NATIVE_CUDA_FLAGS="-DKVFUSE_PREFILL_FP8_ONE_LEVEL=1" PYTHONPATH=/tmp/site:/tmp/one timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/ops/test_native_prefill.py -k "position_dependent or constant_values" > $R/tests_prefill_one.log 2>&1)
echo "one rc=$? $(tail -n 1 $R/tests_prefill_one.log) ${SECONDS}s"; grep -E "^FAILED|assert abs" $R/tests_prefill_one.log | head -12; save
wait $P1; echo "new rc=$? $(tail -n 1 $R/tests_prefill_new.log) ${SECONDS}s"; grep -E "^FAILED" $R/tests_prefill_new.log | head; save
echo "done ${SECONDS}s"
