set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KVFUSE_NATIVE_BUILD_DIR=$PWD/.kvb BENCH_COMMIT=$(cat .scratch/commit)
R=$OUT/r; mkdir -p $R; cp .scratch/call26e.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid --format=csv | tee $R/gpu.csv
# 0 default | 1 single units at every size (before)
V=("" "-DKVFUSE_ROPE_PAIR_UNITS=0")
for i in 0 1; do
  KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" MAX_JOBS=8 python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build $i:', i.get('built'), i.get('build_seconds'), str(i.get('error'))[:1500])" 2>&1 | grep -A10 '^build' &
done; wait
echo "builds done at ${SECONDS}s"
KVFUSE_FAILURE_LOG=$R/failures.txt timeout 230 python3 -m pytest -q -m gpu -n 12 tests/ops/test_rope_kv_write.py \
  -p no:cacheprovider > $R/gpu_rope.log 2>&1
echo "tests rc=$? at ${SECONDS}s: $(tail -c 300 $R/gpu_rope.log | tail -2)"; head -c 2500 $R/failures.txt 2>/dev/null
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 tests/ops/_native_sanitize.py rope > $R/sanitizer_rope.log 2>&1
echo "memcheck rc=$? ($(tail -2 $R/sanitizer_rope.log | tr '\n' ' ')) at ${SECONDS}s"
VV="write;rope_k+write (native);rope_k+write (native), f32 tables;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables;rope_k+write, f32 half tables;rope_qk+write, f32 half tables;rope_qk+write (triton), f32 half tables;rope_qk+write (native), f32 half tables"
for rep in 1 2; do for i in 0 1; do
  d=$R/b${i}_$rep; mkdir -p $d
  KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 64,1024,4096,16384 \
    --formats fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "bench $d rc=$?"
  [ $SECONDS -gt 560 ] && break 2
done; echo "round $rep done at ${SECONDS}s"; done
grep -h "differ" $R/*/log.txt | sort | uniq -c | head -8
python3 .scratch/summarize26.py $R
tar czf $OUT/call26e.tgz -C $R . && rm -rf $R
