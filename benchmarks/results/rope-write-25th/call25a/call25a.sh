set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KVFUSE_NATIVE_BUILD_DIR=/tmp/kvb BENCH_COMMIT=$(cat .scratch/commit)
R=$OUT/r; mkdir -p $R; cp .scratch/call25a.sh .scratch/summarize25.py $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid,pci.bus_id,clocks.max.sm,driver_version --format=csv | tee $R/gpu.csv
MAX_JOBS=12 python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), str(i.get('error'))[:1500])" 2>&1 | grep -A20 '^build'
echo "build done at ${SECONDS}s"
V="write;rope_k+write (native);rope_k+write (native), f32 tables;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables;rope_k+write, f32 half tables"
for rep in 1 2; do
  d=$R/round$rep; mkdir -p $d
  timeout 220 python3 -m benchmarks.rope_write --quick --out $d --tokens 64,4096,16384 --formats bfloat16,fp8,nvfp4 \
    --variants "$V" > $d/log.txt 2>&1 || echo "round $rep rc=$?"
  echo "round $rep done at ${SECONDS}s"; grep -h "differ" $d/log.txt | head -5
done
python3 .scratch/summarize25.py $R
tar czf $OUT/call25a.tgz -C $R . && rm -rf $R
