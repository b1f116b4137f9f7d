set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/call7.sh $R/
SECONDS=0
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build'
echo "build at ${SECONDS}s"
timeout 130 python3 -m benchmarks.rope_write --tokens 64,4096 --out $R/rope > $R/rope.log 2>&1
echo "rope rc=$? at ${SECONDS}s"; grep -E "^\| (64|4096) \| (fp8|nvfp4)" $R/rope/*.md | cut -d'|' -f2-8,15-18
timeout 130 python3 -m benchmarks.attention --only decode --decode-cases 64:4096,16:16384 --modes fp8,nvfp4 \
  --impls kvfuse_native --rounds 2 --out $R/dec > $R/dec.log 2>&1
echo "bench rc=$? at ${SECONDS}s"
grep -E '^\| decode \|' $R/dec/attention.md | cut -c1-120
left=$((590 - SECONDS))
timeout $left python3 -m pytest -q -m gpu -n 8 tests/ops/test_rope_kv_write.py tests/ops/test_rope_rotation.py tests/compile/test_rope_fusion.py -p no:cacheprovider --tb=short > $R/gpu_tests_rope.log 2>&1
echo "rope tests rc=$? at ${SECONDS}s"; tail -1 $R/gpu_tests_rope.log; grep -E "^(FAILED|ERROR)" $R/gpu_tests_rope.log | head -8
tar czf $OUT/call7.tgz -C $R . && rm -rf $R
