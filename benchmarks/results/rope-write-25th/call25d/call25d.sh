set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KVFUSE_NATIVE_BUILD_DIR=/tmp/kvb BENCH_COMMIT=$(cat .scratch/commit)
R=$OUT/r; mkdir -p $R; cp .scratch/call25d.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid --format=csv | tee $R/gpu.csv
MAX_JOBS=14 python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), str(i.get('error'))[:800])" 2>&1 | grep -A10 '^build'
echo "build done at ${SECONDS}s"
VV="write;rope_k+write (native);rope_k+write (native), f32 tables;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables;rope_k+write, f32 half tables"
for rep in 1 2; do
  d=$R/round$rep; mkdir -p $d
  timeout 150 python3 -m benchmarks.rope_write --quick --out $d --tokens 64,1024,4096,16384 --formats bfloat16,fp8,nvfp4 \
    --variants "$VV" > $d/log.txt 2>&1 || echo "bench $d rc=$?"
  echo "round $rep done at ${SECONDS}s"
done
echo "differences reported:"; grep -h "differ" $R/*/log.txt | sort | uniq -c | head -8
KVFUSE_FAILURE_LOG=$R/failures.txt timeout 260 python3 -m pytest -q -m gpu -n 8 tests/ops/test_rope_kv_write.py \
  tests/ops/test_rope_rotation.py tests/compile/test_rope_fusion.py -p no:cacheprovider > $R/gpu_rope.log 2>&1
echo "tests rc=$? at ${SECONDS}s: $(tail -1 $R/gpu_rope.log)"; head -c 1500 $R/failures.txt 2>/dev/null
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 tests/ops/_native_sanitize.py rope > $R/sanitizer_rope.log 2>&1
echo "memcheck rc=$? ($(tail -2 $R/sanitizer_rope.log | tr '\n' ' ')) at ${SECONDS}s"
python3 .scratch/summarize25.py $R
tar czf $OUT/call25d.tgz -C $R . && rm -rf $R
