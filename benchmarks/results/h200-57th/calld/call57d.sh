# Issue 17, 57th session call d (the session's last 257 s): build tf (-DKVFUSE_ROPE_TABLES_BEFORE_SLOT=1)
# alone; diag.py (interleaved, 15 rounds) at 16, 64 and 256 tokens; then the special-values tests.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=16
R=/tmp/r57d; mkdir -p $R; cp .scratch/call57d.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call57d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid --format=csv > $R/gpu.csv
run() { (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_tf KVFUSE_NATIVE_CUDA_FLAGS="-DKVFUSE_ROPE_TABLES_BEFORE_SLOT=1" PYTHONPATH=/tmp/site:$ROOT "$@"); }
run python3 $ROOT/.scratch/s56/build.py tf > $R/build_tf.log 2>&1; tail -n 1 $R/build_tf.log; echo "build ${SECONDS}s"; save
run timeout 40 python3 $ROOT/.scratch/s57/diag.py $R/diag_tf.json 16 64 256 > $R/diag_tf.txt 2>&1; echo "diag rc=$? ${SECONDS}s"; cat $R/diag_tf.txt; save
run timeout 60 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "special_values" > $R/pytest_tf.txt 2>&1; echo "tests rc=$? ${SECONDS}s"; tail -n 2 $R/pytest_tf.txt; save
