# The final small-block rule (128 threads; FP8 8-element rotary units at 256): build and the native write / rotary write GPU tests.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=14 PYTHONPATH=/tmp/site:$PWD KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_final
R=/tmp/r; mkdir -p $R; cp .scratch/call39e.sh $R/; git diff HEAD -- csrc > $R/small_blocks.patch
SECONDS=0
save() { tar czf $OUT/call39e.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid --format=csv,noheader
python3 .scratch/s29/build.py final > $R/build.log 2>&1; tail -1 $R/build.log; echo "build ${SECONDS}s"
timeout $((330-SECONDS)) python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py tests/ops/test_native.py > $R/tests.log 2>&1; echo "tests rc=$? ${SECONDS}s"; tail -n 3 $R/tests.log
save
