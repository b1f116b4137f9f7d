set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/call7.sh $R/
SECONDS=0
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build'
echo "build at ${SECONDS}s"
timeout 210 python3 -m pytest -q -m gpu tests/ops/test_native_attention.py -n 8 -p no:cacheprovider > $R/t_attn.log 2>&1; echo "test_native_attention: $(tail -1 $R/t_attn.log)"
grep -E "^(FAILED|ERROR)" $R/t_attn.log | head -5
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 --kernel-name kns=decode_attention python3 tests/ops/_native_attention_sanitize.py > $R/sanitizer_attention.log 2>&1
echo "memcheck decode attention rc=$? ($(tail -2 $R/sanitizer_attention.log | tr '\n' ' '))"
echo "checks at ${SECONDS}s"
timeout 200 python3 -m benchmarks.attention --only decode --decode-cases 64:4096,16:16384 --modes bf16,fp8,nvfp4 --impls kvfuse,kvfuse_native,flashinfer,flashinfer_tc,torch_sdpa --rounds 2 --out $R > $R/attention.log 2>&1
echo "attention rc=$?"; grep "copy bandwidth" $R/attention.log
grep -E "kvfuse_native" $R/attention.md
timeout 120 python3 -m benchmarks.decode_step --out $R > $R/decode_step.log 2>&1; echo "decode_step rc=$?"; grep -E "^\|" $R/decode_step.log | tail -8
echo "done at ${SECONDS}s"
tar czf $OUT/call7.tgz -C $R . && rm -rf $R
