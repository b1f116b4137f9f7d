set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1
R=$OUT/r; mkdir -p $R; cp .scratch/pipe2.sh $R/
SECONDS=0
# 2 rows_kernel only (pairs packed) | 4 pipelined, 3 blocks/SM | 5 pipelined, 512-unit stages | 6 pipelined, 2 stages of 512 units
V=("" "" "-DKVFUSE_ROPE_PIPELINED_FROM=4294967296" "" "-DKVFUSE_ROPE_PIPE_BLOCKS=3" "-DKVFUSE_ROPE_PIPE_UNITS=512" "-DKVFUSE_ROPE_PIPE_STAGES=2 -DKVFUSE_ROPE_PIPE_UNITS=512")
for i in 2 4 5 6; do
  KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" MAX_JOBS=4 python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build $i:', i.get('built'), i.get('build_seconds'), str(i.get('error'))[:3000])" 2>&1 | grep -A30 '^build' &
done; wait
echo "builds done at ${SECONDS}s"
for rep in 1 2; do for i in 2 4 5 6; do
  d=b${i}_$rep; mkdir -p $R/$d
  KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" timeout 100 python3 -m benchmarks.rope_write --quick --out $R/$d --tokens 4096,16384 \
    --formats fp8,nvfp4 --variants "write;rope_k+write (native)" > $R/$d/log.txt 2>&1 || echo "bench $d failed"
done; done
echo "benches done at ${SECONDS}s"; grep -h "differ\|Error\|error" $R/*/log.txt | head -5
python3 - <<'PY'
import json, os
R = os.environ["OUT"] + "/r/"
for rep in (1, 2):
  for i in (2, 4, 5, 6):
    tag = f"b{i}_{rep}"
    try:
        rows = json.load(open(f"{R}{tag}/rope_write.json"))["rows"]
    except Exception as e:
        print(tag, "no json", e); continue
    for r in rows:
        g = lambda k: r.get(k) if r.get(k) is not None else float("nan")
        print(f"{tag} {r['tokens']:6d} {r['format']:5s} | write {g('write'):6.2f} | native {g('rope_k+write (native)'):6.2f} ({g('rope_k+write (native)')/g('write'):.3f})")
PY
tar czf $OUT/pipe2.tgz -C $R . && rm -rf $R
