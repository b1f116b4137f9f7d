set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=8
R=$OUT/r; mkdir -p $R; cp .scratch/call7.sh .scratch/ab_nvfp4.py $R/
SECONDS=0
H1="-DKVFUSE_DECODE_NVFP4_HEADS=4"
KVFUSE_NATIVE_CUDA_FLAGS="$H1" python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build quads:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build' &
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build pairs:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build'
wait
echo "builds at ${SECONDS}s"
for round in 1 2; do
  timeout 100 python3 .scratch/ab_nvfp4.py $R/pairs_$round.json 1 4 > $R/pairs_$round.log 2>&1 || echo "ab pairs failed"
  KVFUSE_NATIVE_CUDA_FLAGS="$H1" timeout 100 python3 .scratch/ab_nvfp4.py $R/quads_$round.json 1,2 4,8 > $R/quads_$round.log 2>&1 || echo "ab quads failed"
done
echo "ab at ${SECONDS}s"
KVFUSE_NATIVE_CUDA_FLAGS="$H1" timeout 150 python3 -m pytest -q -m gpu -n 8 tests/ops/test_native_attention.py -k NVFP4 -p no:cacheprovider --tb=short > $R/gpu_tests_quads.log 2>&1
echo "pytest quads rc=$? at ${SECONDS}s"; tail -1 $R/gpu_tests_quads.log; grep -E "^(FAILED|ERROR)" $R/gpu_tests_quads.log | head -5
python3 - <<'PY'
import json, os
R = os.environ["OUT"] + "/r/"
for v in ("pairs", "quads"):
    for rnd in (1, 2):
        try:
            d = json.load(open(f"{R}{v}_{rnd}.json"))
        except Exception as e:
            print(v, rnd, "missing", e); continue
        print(v, rnd, "copy", round(d["copy_gb_per_s"]), [(r["mode"], r["batch"], r["splits"], r["us"]) for r in d["rows"]])
PY
tar czf $OUT/call7.tgz -C $R . && rm -rf $R
