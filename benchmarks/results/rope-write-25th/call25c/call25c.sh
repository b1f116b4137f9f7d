set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KVFUSE_NATIVE_BUILD_DIR=/tmp/kvb BENCH_COMMIT=$(cat .scratch/commit)
R=$OUT/r; mkdir -p $R; cp .scratch/call25c.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid --format=csv | tee $R/gpu.csv
# 0 default | 1 FP8 8-element units at every size | 2 float32 tables without the extra block given up
V=("" "-DKVFUSE_ROPE_FP8_NARROW_BELOW=1073741824" "-DKVFUSE_ROPE_F32_TABLE_FEWER_BLOCKS=0")
for i in 0 1 2; do
  KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" MAX_JOBS=5 python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build $i:', i.get('built'), i.get('build_seconds'), str(i.get('error'))[:800])" 2>&1 | grep -A10 '^build' &
done; wait
echo "builds done at ${SECONDS}s"
VV="write;rope_k+write (native);rope_k+write (native), f32 tables;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
for rep in 1 2; do for i in 0 1 2; do
  d=$R/b${i}_$rep; mkdir -p $d
  KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" timeout 120 python3 -m benchmarks.rope_write --quick --out $d --tokens 1024,4096,16384 \
    --formats fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "bench $d rc=$?"
done; echo "round $rep done at ${SECONDS}s"; done
grep -h "differ" $R/*/log.txt | sort | uniq -c | head -8
python3 .scratch/summarize25.py $R
tar czf $OUT/call25c.tgz -C $R . && rm -rf $R
