set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KVFUSE_NATIVE_BUILD_DIR=$PWD/.kvb
R=$OUT/r; mkdir -p $R; cp .scratch/call26f.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid --format=csv | tee $R/gpu.csv
MAX_JOBS=16 python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), str(i.get('error'))[:1500])" 2>&1 | grep -A10 '^build'
echo "build done at ${SECONDS}s"
KVFUSE_FAILURE_LOG=$R/failures.txt timeout 260 python3 -m pytest -q -rf -m gpu -n 14 tests/ops/test_rope_kv_write.py \
  -k "unit_pairs or prefill_shapes or neox_partners" -p no:cacheprovider > $R/gpu_rope.log 2>&1
echo "tests rc=$? at ${SECONDS}s: $(tail -c 400 $R/gpu_rope.log | tail -3)"; head -c 2500 $R/failures.txt 2>/dev/null
KVFUSE_FAILURE_LOG=$R/failures2.txt timeout 120 python3 -m pytest -q -rf -m gpu -n 9 tests/ops/test_rope_rotation.py \
  tests/compile/test_rope_fusion.py -p no:cacheprovider > $R/gpu_rope2.log 2>&1
echo "tests2 rc=$? at ${SECONDS}s: $(tail -c 400 $R/gpu_rope2.log | tail -3)"; head -c 2500 $R/failures2.txt 2>/dev/null
tar czf $OUT/call26f.tgz -C $R . && rm -rf $R
