set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/call3.sh $R/
SECONDS=0
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build'
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
timeout 300 python3 -m benchmarks.attention --only decode --decode-cases 64:4096,16:16384 --modes bf16,fp8,nvfp4 \
  --impls kvfuse,kvfuse_native,flashinfer,flashinfer_tc,torch_sdpa --rounds 2 --out $R/dec > $R/dec.log 2>&1
echo "bench rc=$? at ${SECONDS}s"
timeout 150 python3 -m pytest -q -m gpu -n 8 tests/ops/test_native_attention.py -p no:cacheprovider --tb=short > $R/gpu_tests.log 2>&1
echo "pytest rc=$? at ${SECONDS}s"; tail -1 $R/gpu_tests.log; grep -E "^(FAILED|ERROR)" $R/gpu_tests.log | head -8
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 \
  --kernel-name kns=decode_attention python3 tests/ops/_native_attention_sanitize.py > $R/sanitizer_attention.log 2>&1
echo "memcheck attention rc=$? at ${SECONDS}s: $(tail -3 $R/sanitizer_attention.log | tr '\n' ' ')"
timeout 60 ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__sass_l1tex_m_xbar2l1tex_read_sectors_mem_global_op_ldgsts_cache_bypass.sum \
    python3 .scratch/prof_dec_fp8.py > $R/ncu.txt 2>&1
grep -E "decode_attention|duration|dram__|xbar" $R/ncu.txt | sed 's/  */ /g' | cut -c1-110
echo "done at ${SECONDS}s"
grep -E '^\| decode' $R/dec/attention.md | cut -c1-120
tar czf $OUT/call3.tgz -C $R . && rm -rf $R
