set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=8
R=$OUT/r; mkdir -p $R; cp .scratch/call4.sh .scratch/probe_reads.py $R/
SECONDS=0
declare -A FL=( [fast]="" [seqs]="-DKVFUSE_DECODE_HEADS_FASTEST=0" )
KVFUSE_NATIVE_CUDA_FLAGS="${FL[seqs]}" python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build seqs:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build' &
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build fast:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build'
wait
echo "builds at ${SECONDS}s"
timeout 120 python3 .scratch/probe_reads.py $R/probe_reads.json > $R/probe.log 2>&1; echo "probe rc=$? at ${SECONDS}s"
timeout 170 python3 -m pytest -q -m gpu -n 8 tests/ops/test_native_attention.py -p no:cacheprovider --tb=short -x > $R/gpu_tests.log 2>&1
echo "pytest rc=$? at ${SECONDS}s"; tail -1 $R/gpu_tests.log; grep -E "^(FAILED|ERROR)" $R/gpu_tests.log | head -8
for round in 1 2; do
  for v in fast seqs; do
    KVFUSE_NATIVE_CUDA_FLAGS="${FL[$v]}" timeout 100 python3 -m benchmarks.attention --only decode --decode-cases 64:4096,16:16384 \
      --modes fp8,nvfp4 --impls kvfuse_native --out $R/${v}_$round > /dev/null 2>&1 || echo "bench $v failed"
  done
done
echo "benches at ${SECONDS}s"
python3 - <<'PY'
import json, os
R = os.environ["OUT"] + "/r/"
for r in json.load(open(R + "probe_reads.json"))["rows"]:
    print("probe", r)
for v in ("fast", "seqs"):
    for rnd in (1, 2):
        try:
            d = json.load(open(f"{R}{v}_{rnd}/attention.json"))
        except Exception as e:
            print(v, rnd, "missing", e); continue
        print(v, rnd, "copy", round(d["copy_gb_per_s"]), [(r["kv_cache_dtype"], r["batch"], r["context"], r["us"]) for r in d["rows"]])
PY
tar czf $OUT/call4.tgz -C $R . && rm -rf $R
