set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/call4.sh $R/
SECONDS=0
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build'
echo "build at ${SECONDS}s"
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
timeout 70 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/ops/_native_sanitize.py > $R/sanitizer_write.log 2>&1
echo "memcheck write rc=$? at ${SECONDS}s: $(tail -1 $R/sanitizer_write.log)"
timeout 70 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/ops/_native_sanitize.py rope > $R/sanitizer_rope.log 2>&1
echo "memcheck rope rc=$? at ${SECONDS}s: $(tail -1 $R/sanitizer_rope.log)"
timeout 70 compute-sanitizer --tool memcheck --error-exitcode 9 --kernel-name kns=decode_attention python3 tests/ops/_native_attention_sanitize.py > $R/sanitizer_attention.log 2>&1
echo "memcheck attention rc=$? at ${SECONDS}s: $(tail -1 $R/sanitizer_attention.log)"
unset PYTORCH_NO_CUDA_MEMORY_CACHING
timeout 150 python3 -m pytest -q -m gpu -n 8 tests/models tests/compile tests/integrations tests/ops/test_per_token_head.py --deselect tests/compile/test_rope_fusion.py -p no:cacheprovider --tb=short > $R/gpu_models.log 2>&1
echo "models rc=$? at ${SECONDS}s"; tail -1 $R/gpu_models.log; grep -E "^(FAILED|ERROR)" $R/gpu_models.log | head -5
timeout 120 python3 -m benchmarks.decode_step --out $R/step > $R/step.log 2>&1
echo "step rc=$? at ${SECONDS}s"; tail -6 $R/step.log
left=$((585 - SECONDS))
timeout $left python3 -m benchmarks.rope_write --tokens 64,4096 --out $R/rope > $R/rope.log 2>&1
echo "rope rc=$? at ${SECONDS}s"; grep -E "^\|" $R/rope/*.md | cut -c1-160 | head -20
tar czf $OUT/call4.tgz -C $R . && rm -rf $R
