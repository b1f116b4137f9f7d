# 48th session call d: the compile pass's GPU tests (fused vs unfused graph, bit-exact caches, every
# rotary style, bf16 / FP8 / NVFP4) and the decode-loop memory test at the landed tree.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=16 PYTHONPATH=/tmp/site:$PWD
R=/tmp/r48d; mkdir -p $R; cp .scratch/call48d.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0
save() { tar czf $OUT/call48d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
python3 -c "from kvfuse.ops import native; print(native.build_info(build=True))" > $R/build.log 2>&1; tail -n 2 $R/build.log; echo "build ${SECONDS}s"
timeout 330 python3 -m pytest -v --tb=short -m gpu -n 9 tests/compile -p no:cacheprovider -rfE > $R/tests_compile.txt 2>&1; echo "compile tests rc=$? ${SECONDS}s"; tail -n 3 $R/tests_compile.txt
save
timeout 100 python3 -m pytest -q -m gpu tests/models/test_memory.py -p no:cacheprovider > $R/tests_memory.txt 2>&1; echo "memory rc=$? ${SECONDS}s"; tail -n 2 $R/tests_memory.txt
save; echo "done ${SECONDS}s"
