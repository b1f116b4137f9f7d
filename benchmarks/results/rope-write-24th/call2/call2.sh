set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R; cp .scratch/call2.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid,pci.bus_id,clocks.max.sm,driver_version --format=csv | tee $R/gpu.csv
# 0 HEAD's rotary load | 1 the same load split as at b0837fc (SASS identical to b0837fc's rows_kernel)
V=("" "-DKVFUSE_ROPE_LOAD_SPLIT=1")
for i in 0 1; do
  KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" MAX_JOBS=8 python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build $i:', i.get('built'), i.get('build_seconds'), str(i.get('error'))[:1500])" 2>&1 | grep -A20 '^build' &
done; wait
echo "builds done at ${SECONDS}s"
for rep in 1 2; do for i in 0 1; do
  d=b${i}_$rep; mkdir -p $R/$d
  KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" timeout 90 python3 -m benchmarks.rope_write --quick --out $R/$d --tokens 64,1024,4096,16384 \
    --formats bfloat16,fp8,nvfp4 --variants "write;rope_k+write (native)" > $R/$d/log.txt 2>&1 || echo "bench $d failed"
done; done
echo "A/B done at ${SECONDS}s"; grep -h "differ" $R/*/log.txt | head -8
python3 .scratch/summarize1.py $R 2>&1 | grep "^b"
tar czf $OUT/call2_ab.tgz -C $R .
KVFUSE_NATIVE_CUDA_FLAGS="${V[1]}" KVFUSE_FAILURE_LOG=$R/failures.txt timeout 200 python3 -m pytest -q -m gpu -n 6 \
  tests/ops/test_rope_kv_write.py tests/ops/test_rope_rotation.py tests/compile/test_rope_fusion.py -p no:cacheprovider > $R/gpu_rope.log 2>&1
echo "tests rc=$? at ${SECONDS}s: $(tail -1 $R/gpu_rope.log)"; head -c 1500 $R/failures.txt 2>/dev/null
KVFUSE_NATIVE_CUDA_FLAGS="${V[1]}" PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 tests/ops/_native_sanitize.py rope > $R/sanitizer_rope.log 2>&1
echo "memcheck rc=$? ($(tail -2 $R/sanitizer_rope.log | tr '\n' ' ')) at ${SECONDS}s"
mkdir -p $R/full; KVFUSE_NATIVE_CUDA_FLAGS="${V[1]}" timeout 150 python3 -m benchmarks.rope_write --quick --out $R/full > $R/full/log.txt 2>&1
echo "full quick bench rc=$? at ${SECONDS}s"; grep '^|' $R/full/log.txt | cut -c1-220
tar czf $OUT/call2.tgz -C $R . && rm -rf $R
