# Issue 17, 54th session call d: the remaining native rotary GPU tests on b518d0c (NeoX partners,
# shapes and pages, 16-bit caches, special values, routing).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=12
R=/tmp/r54d; mkdir -p $R; cp .scratch/call54d.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call54d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid --format=csv > $R/gpu.csv
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_t PYTHONPATH=/tmp/site:$ROOT python3 .scratch/s54/build.py t > $R/build_t.log 2>&1; tail -n 1 $R/build_t.log; echo "build ${SECONDS}s"
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_t PYTHONPATH=/tmp/site:$ROOT timeout 150 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "neox_partners or shapes_and_pages or 16bit_caches or special_values or routing" > $R/pytest_rope_rest.txt 2>&1; echo "pytest rc=$? ${SECONDS}s"; tail -n 2 $R/pytest_rope_rest.txt
save; echo "done ${SECONDS}s"
