set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=8
R=$OUT/r; mkdir -p $R; cp .scratch/call5.sh .scratch/ab_nvfp4.py $R/
SECONDS=0
H1="-DKVFUSE_DECODE_NVFP4_HEADS=1"
KVFUSE_NATIVE_CUDA_FLAGS="$H1" python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build heads1:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build' &
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build pairs:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build'
wait
echo "builds at ${SECONDS}s"
timeout 180 python3 -m pytest -q -m gpu -n 8 tests/ops/test_native_attention.py -p no:cacheprovider --tb=short -x > $R/gpu_tests.log 2>&1
echo "pytest rc=$? at ${SECONDS}s"; tail -1 $R/gpu_tests.log; grep -E "^(FAILED|ERROR)" $R/gpu_tests.log | head -8
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 \
  --kernel-name kns=decode_attention python3 tests/ops/_native_attention_sanitize.py > $R/sanitizer_attention.log 2>&1
echo "memcheck rc=$? at ${SECONDS}s: $(tail -2 $R/sanitizer_attention.log | tr '\n' ' ')"
for round in 1 2; do
  timeout 100 python3 .scratch/ab_nvfp4.py $R/pairs_$round.json 1,2 4,8 > $R/pairs_$round.log 2>&1 || echo "ab pairs failed"
  KVFUSE_NATIVE_CUDA_FLAGS="$H1" timeout 100 python3 .scratch/ab_nvfp4.py $R/heads1_$round.json 1 4 > $R/heads1_$round.log 2>&1 || echo "ab heads1 failed"
done
echo "ab at ${SECONDS}s"
python3 - <<'PY'
import json, os
R = os.environ["OUT"] + "/r/"
for v in ("pairs", "heads1"):
    for rnd in (1, 2):
        try:
            d = json.load(open(f"{R}{v}_{rnd}.json"))
        except Exception as e:
            print(v, rnd, "missing", e); continue
        print(v, rnd, "copy", round(d["copy_gb_per_s"]), [(r["mode"], r["batch"], r["splits"], r["us"]) for r in d["rows"]])
PY
tar czf $OUT/call5.tgz -C $R . && rm -rf $R
