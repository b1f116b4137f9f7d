set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1
R=$OUT/r; mkdir -p $R; cp .scratch/pipe7.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid,pci.bus_id --format=csv | tee $R/gpu.csv
# 0 default (values first) | 1 values with the keys, after the rotation (as at 86f3c0a)
V=("" "-DKVFUSE_ROPE_VALUES_FIRST=0")
for i in 0 1; do
  KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" MAX_JOBS=8 python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build $i:', i.get('built'), i.get('build_seconds'), str(i.get('error'))[:2000])" 2>&1 | grep -A20 '^build' &
done; wait
echo "builds done at ${SECONDS}s"
KVFUSE_FAILURE_LOG=$R/failures.txt timeout 170 python3 -m pytest -q -m gpu -n 6 -k native tests/ops/test_rope_kv_write.py \
  -p no:cacheprovider --tb=short > $R/gpu_rope_native.log 2>&1
echo "pytest rc=$? at ${SECONDS}s"; tail -2 $R/gpu_rope_native.log
for rep in 1 2; do for i in 1 0; do
  d=b${i}_$rep; mkdir -p $R/$d
  KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" timeout 100 python3 -m benchmarks.rope_write --quick --out $R/$d --tokens 256,1024,4096,16384 \
    --formats fp8,nvfp4 --variants "write;rope_k+write (native)" > $R/$d/log.txt 2>&1 || echo "bench $d failed"
done; done
echo "benches done at ${SECONDS}s"; grep -h "differ" $R/*/log.txt | head -8
python3 - <<'PY'
import json, os
R = os.environ["OUT"] + "/r/"
for rep in (1, 2):
  for i in (1, 0):
    tag = f"b{i}_{rep}"
    try: rows = json.load(open(f"{R}{tag}/rope_write.json"))["rows"]
    except Exception as e: print(tag, "no json", e); continue
    for r in rows:
        g = lambda k: r.get(k) if r.get(k) is not None else float("nan")
        print(f"{tag} {r['tokens']:6d} {r['format']:5s} | write {g('write'):6.2f} | native {g('rope_k+write (native)'):6.2f} ({g('rope_k+write (native)')/g('write'):.3f})")
PY
tar czf $OUT/pipe7.tgz -C $R . && rm -rf $R
