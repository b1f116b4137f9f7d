set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KVFUSE_NATIVE_BUILD_DIR=$PWD/.kvb BENCH_COMMIT=$(cat .scratch/commit)
R=$OUT/r; mkdir -p $R; cp .scratch/call26g.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid --format=csv | tee $R/gpu.csv
MAX_JOBS=16 python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), str(i.get('error'))[:1500])" 2>&1 | grep -A10 '^build'
echo "build done at ${SECONDS}s"
KVFUSE_FAILURE_LOG=$R/failures.txt timeout 150 python3 -m pytest -q -rf -m gpu -n 14 tests/ops/test_rope_kv_write.py \
  -k "unit_pairs or bit_exact" -p no:cacheprovider > $R/gpu_rope.log 2>&1
echo "tests rc=$? at ${SECONDS}s: $(tail -c 300 $R/gpu_rope.log | tail -2)"; head -c 2500 $R/failures.txt 2>/dev/null
VV="write;rope_k+write (native);rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
d=$R/b0_1; mkdir -p $d
timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 1024,2048,4096 --formats fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "bench rc=$?"
grep -h "differ" $R/*/log.txt | sort | uniq -c | head -8
python3 .scratch/summarize26.py $R
tar czf $OUT/call26g.tgz -C $R . && rm -rf $R
