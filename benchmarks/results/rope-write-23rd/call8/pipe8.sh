set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1
R=$OUT/r; mkdir -p $R/def $R/wide; cp .scratch/pipe8.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid --format=csv | tee $R/gpu.csv
V=("" "-DKVFUSE_ROPE_FP8_NARROW_BELOW=0")
for i in 0 1; do
  KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" MAX_JOBS=8 python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build $i:', i.get('built'), i.get('build_seconds'), str(i.get('error'))[:2000])" 2>&1 | grep -A20 '^build' &
done; wait
echo "builds done at ${SECONDS}s"
KVFUSE_FAILURE_LOG=$R/failures.txt timeout 200 python3 -m pytest -q -m gpu -n 6 -k "native" tests/ops/test_rope_kv_write.py \
  -p no:cacheprovider --tb=short > $R/gpu_rope_native.log 2>&1
echo "pytest rc=$? at ${SECONDS}s"; tail -2 $R/gpu_rope_native.log; grep -E "FAILED|Error" $R/gpu_rope_native.log | head -5
timeout 150 python3 -m benchmarks.rope_write --quick --out $R/def --tokens 1,16,64,256,1024,4096,16384 --formats bfloat16,nvfp4 \
  --variants "write;rope_k+write;rope_k+write (native);rope_k+write (triton)" > $R/def/log.txt 2>&1 || echo "bench def failed"
KVFUSE_NATIVE_CUDA_FLAGS="${V[1]}" timeout 80 python3 -m benchmarks.rope_write --quick --out $R/wide --tokens 1,16,64,256,1024 --formats bfloat16 \
  --variants "write;rope_k+write (native)" > $R/wide/log.txt 2>&1 || echo "bench wide failed"
echo "benches done at ${SECONDS}s"; grep -h "differ" $R/*/log.txt | head -8
python3 - <<'PY'
import json, os
R = os.environ["OUT"] + "/r/"
for tag in ("def", "wide"):
    try: rows = json.load(open(f"{R}{tag}/rope_write.json"))["rows"]
    except Exception as e: print(tag, "no json", e); continue
    for r in rows:
        g = lambda k: r.get(k) if r.get(k) is not None else float("nan")
        print(f"{tag} {r['tokens']:6d} {r['format']:9s} | write {g('write'):6.2f} | op {g('rope_k+write'):6.2f} | native {g('rope_k+write (native)'):6.2f} ({g('rope_k+write (native)')/g('write'):.3f}) | triton {g('rope_k+write (triton)'):6.2f} ({g('rope_k+write (triton)')/g('write'):.3f})")
PY
tar czf $OUT/pipe8.tgz -C $R . && rm -rf $R
