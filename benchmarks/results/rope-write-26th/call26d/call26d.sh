set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KVFUSE_NATIVE_BUILD_DIR=$PWD/.kvb BENCH_COMMIT=$(cat .scratch/commit)
R=$OUT/r; mkdir -p $R; cp .scratch/call26d.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid --format=csv | tee $R/gpu.csv
# 0 default | 1 single units at every size (before) | 2 default without the 8-byte store hint
V=("" "-DKVFUSE_ROPE_PAIR_UNITS=0" "-DKVFUSE_NARROW_STORE_HINT=0")
for i in 0 1 2; do
  KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" MAX_JOBS=5 python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build $i:', i.get('built'), i.get('build_seconds'), str(i.get('error'))[:1500])" 2>&1 | grep -A10 '^build' &
done; wait
echo "builds done at ${SECONDS}s"
VV="write;rope_k+write (native);rope_k+write (native), f32 tables;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
for rep in 1 2; do for i in 0 1 2; do
  d=$R/b${i}_$rep; mkdir -p $d
  KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" timeout 75 python3 -m benchmarks.rope_write --quick --out $d --tokens 1,64,1024,2048,4096,16384 \
    --formats fp8,nvfp4,bfloat16 --variants "$VV" > $d/log.txt 2>&1 || echo "bench $d rc=$?"
done; echo "round $rep done at ${SECONDS}s"; done
grep -h "differ" $R/*/log.txt | sort | uniq -c | head -8
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 tests/ops/_native_sanitize.py rope > $R/sanitizer_rope.log 2>&1
echo "memcheck rc=$? ($(tail -2 $R/sanitizer_rope.log | tr '\n' ' ')) at ${SECONDS}s"
python3 .scratch/summarize26.py $R
tar czf $OUT/call26d.tgz -C $R . && rm -rf $R
