set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1
R=$OUT/r; mkdir -p $R; cp .scratch/pipe1.sh $R/
SECONDS=0
# 0 default (pipelined from 65536 units) | 1 pipelined everywhere (tests) | 2 rows_kernel only, pairs packed | 3 rows_kernel, as at dd8ff90
V=("" "-DKVFUSE_ROPE_PIPELINED_FROM=0" "-DKVFUSE_ROPE_PIPELINED_FROM=4294967296" "-DKVFUSE_ROPE_PIPELINED_FROM=4294967296 -DKVFUSE_ROPE_PACK_PAIRS=0")
for i in 0 1 2 3; do
  KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" MAX_JOBS=4 python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build $i:', i.get('built'), i.get('build_seconds'), str(i.get('error'))[:3000])" 2>&1 | grep -A30 '^build' &
done; wait
echo "builds done at ${SECONDS}s"
KVFUSE_NATIVE_CUDA_FLAGS="${V[1]}" KVFUSE_FAILURE_LOG=$R/failures1.txt timeout 170 python3 -m pytest -q -x -m gpu -k "native" \
  tests/ops/test_rope_kv_write.py -p no:cacheprovider > $R/tests1.txt 2>&1; echo "tests v1 rc=$? at ${SECONDS}s"; tail -3 $R/tests1.txt
for rep in 1 2; do for i in 3 2 0; do
  d=b${i}_$rep; mkdir -p $R/$d
  KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" timeout 100 python3 -m benchmarks.rope_write --quick --out $R/$d --tokens 1024,4096,16384 \
    --formats fp8,nvfp4 --variants "write;rope_k+write (native)" > $R/$d/log.txt 2>&1 || echo "bench $d failed"
done; done
echo "benches done at ${SECONDS}s"; grep -h "differ\|Error\|error" $R/*/log.txt | head -5
python3 - <<'PY'
import json, os
R = os.environ["OUT"] + "/r/"
for tag in ("b3_1", "b2_1", "b0_1", "b3_2", "b2_2", "b0_2"):
    try:
        rows = json.load(open(f"{R}{tag}/rope_write.json"))["rows"]
    except Exception as e:
        print(tag, "no json", e); continue
    for r in rows:
        g = lambda k: r.get(k) if r.get(k) is not None else float("nan")
        print(f"{tag} {r['tokens']:6d} {r['format']:5s} | write {g('write'):6.2f} | native {g('rope_k+write (native)'):6.2f} ({g('rope_k+write (native)')/g('write'):.3f})")
PY
tar czf $OUT/pipe1.tgz -C $R . && rm -rf $R
