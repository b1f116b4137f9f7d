set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=12
R=/tmp/r; mkdir -p $R; cp .scratch/call32f.sh $R/
SECONDS=0
save() { tar czf $OUT/call32f.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid --format=csv > $R/gpu.csv; cat $R/gpu.csv
export PYTHONPATH=/tmp/site:$PWD KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_final
python3 .scratch/s29/build.py final > $R/build_final.log 2>&1; tail -n 1 $R/build_final.log; echo "build ${SECONDS}s"; save
T=$((290-SECONDS))
timeout $T python3 -m pytest -v -p no:cacheprovider -m gpu -n 9 tests/compile/test_rope_fusion.py > $R/tests_fusion.log 2>&1 &
P1=$!
timeout $T python3 -m pytest -q -p no:cacheprovider -m gpu -n 6 -k "unit_pairs or prefill_shapes or nvfp4_pages or bit_exact" tests/ops/test_rope_kv_write.py > $R/tests_pairs.log 2>&1 &
P2=$!
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout $T compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/ops/_native_sanitize.py rope > $R/memcheck_rope.log 2>&1 &
P3=$!
wait $P2; echo "pairs rc=$? $(tail -n 1 $R/tests_pairs.log) ${SECONDS}s"; save
wait $P1; echo "fusion rc=$? $(tail -n 1 $R/tests_fusion.log) ${SECONDS}s"; grep -c PASSED $R/tests_fusion.log; save
wait $P3; echo "memcheck rc=$? $(tail -n 2 $R/memcheck_rope.log | tr '\n' ' ') ${SECONDS}s"
save; echo "done ${SECONDS}s"
