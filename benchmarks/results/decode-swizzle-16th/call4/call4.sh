set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=8
R=$OUT/r; mkdir -p $R; cp .scratch/call4.sh $R/
SECONDS=0
OLD="-DKVFUSE_DECODE_PDL=0"
KVFUSE_NATIVE_CUDA_FLAGS="$OLD" python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build nopdl:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build' &
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build pdl:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build'
wait
echo "builds at ${SECONDS}s"
for round in 1 2; do
  for v in pdl nopdl; do
    F=""; [ $v = nopdl ] && F="$OLD"
    KVFUSE_NATIVE_CUDA_FLAGS="$F" timeout 100 python3 -m benchmarks.attention --only decode --decode-cases 64:4096,16:16384 \
      --modes fp8,nvfp4 --impls kvfuse_native --out $R/${v}_$round > /dev/null 2>&1 || echo "bench $v failed"
  done
done
echo "benches at ${SECONDS}s"
python3 - <<'PY'
import json, os
R = os.environ["OUT"] + "/r/"
for v in ("pdl", "nopdl"):
    for rnd in (1, 2):
        d = json.load(open(f"{R}{v}_{rnd}/attention.json"))
        print(v, rnd, "copy", round(d["copy_gb_per_s"]), [(r["kv_cache_dtype"][:5], r["batch"], r["context"], r["us"], r["frac_of_copy"]) for r in d["rows"]])
PY
timeout 170 python3 -m pytest -q -m gpu -n 8 tests/ops/test_native_attention.py -p no:cacheprovider --tb=short > $R/gpu_tests.log 2>&1
echo "pytest rc=$? at ${SECONDS}s"; tail -1 $R/gpu_tests.log; grep -E "^(FAILED|ERROR)|Error" $R/gpu_tests.log | head -8
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 \
  --kernel-name kns=decode_attention python3 tests/ops/_native_attention_sanitize.py > $R/sanitizer_attention.log 2>&1
echo "memcheck attention rc=$? at ${SECONDS}s: $(tail -3 $R/sanitizer_attention.log | tr '\n' ' ')"
tar czf $OUT/call4.tgz -C $R . && rm -rf $R
