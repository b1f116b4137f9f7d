set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/call1.sh $R/
SECONDS=0
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build'
timeout 200 python3 -m pytest -q -m gpu -n 8 tests/ops/test_rope_kv_write.py -p no:cacheprovider \
  --tb=short > $R/gpu_tests.log 2>&1
echo "pytest rc=$? at ${SECONDS}s"; tail -1 $R/gpu_tests.log; grep -E "^(FAILED|ERROR)" $R/gpu_tests.log | head -8
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 tests/ops/_native_sanitize.py rope > $R/sanitizer_rope.log 2>&1
echo "memcheck rope rc=$? at ${SECONDS}s: $(tail -3 $R/sanitizer_rope.log | tr '\n' ' ')"
timeout 150 ncu --profile-from-start off --clock-control none --set full -o $R/dec python3 .scratch/prof_decode.py > $R/ncu.log 2>&1
echo "ncu rc=$? at ${SECONDS}s"
ncu -i $R/dec.ncu-rep --page details > $R/dec_details.txt 2>&1
ncu -i $R/dec.ncu-rep --page raw --csv > $R/dec_raw.csv 2>&1
grep -E "^  [a-z_]|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|Executed Ipc A" $R/dec_details.txt | head -80
timeout 150 python3 -m benchmarks.attention --only decode --decode-cases 64:4096,16:16384 --modes bf16,fp8,nvfp4 \
  --impls kvfuse,kvfuse_native --out $R 2>&1 | grep -E '^\|' | cut -c1-160
echo "done at ${SECONDS}s"
tar czf $OUT/call1.tgz -C $R . && rm -rf $R
