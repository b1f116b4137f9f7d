set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/call27f.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid --format=csv > $R/gpu.csv
python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('build', i['built'], i['build_seconds'], i['error'])" > $R/build.log 2>&1; tail -1 $R/build.log; echo "build ${SECONDS}s"
(timeout 150 python3 .scratch/promote_probe.py triton > $R/probe_triton.jsonl 2>$R/probe_triton.err; echo "probe triton rc=$?" >> $R/probe_triton.err) &
KVFUSE_FAILURE_LOG=$R/failures_native.txt timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu -n 10 tests/ops/test_native_prefill.py > $R/tests_native_prefill.log 2>&1; echo "native_prefill rc=$? $(tail -n 1 $R/tests_native_prefill.log) ${SECONDS}s"; grep -h "^E  " $R/failures_native.txt 2>/dev/null | head -4
KVFUSE_FAILURE_LOG=$R/failures_triton.txt timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -n 12 tests/ops/test_quantized_prefill.py tests/ops/test_new_token_prefill.py -k "fp8 or FP8 or constant" > $R/tests_triton_fp8.log 2>&1; echo "triton fp8 rc=$? $(tail -n 1 $R/tests_triton_fp8.log) ${SECONDS}s"; grep -h "^E  \|^===" $R/failures_triton.txt 2>/dev/null | head -8
wait; tail -n 1 $R/probe_triton.err
python3 - $R/probe_triton.jsonl <<'PY'
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); print(r["label"], r["seq"], r["kind"], "max", r["max_abs"], "mean_abs", r["mean_abs"], "rel", r["mean_signed_rel"], "last", r["last_rows_signed_rel"])
PY
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 40 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 --kernel-name kns=prefill_attention python3 tests/ops/_native_prefill_sanitize.py > $R/memcheck.log 2>&1; echo "memcheck rc=$? ${SECONDS}s"; tail -n 1 $R/memcheck.log
tar czf $OUT/call27f.tgz -C $R . && rm -rf $R
