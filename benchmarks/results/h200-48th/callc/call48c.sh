# Issue 17, 48th session call c: the final tree (FP8 pairs over full-width 16-bit tables budgeted for 9
# blocks in paired and prefetching launches only): the whole rotary write benchmark with FlashInfer,
# then the unit-pair and 16-bit-cache GPU tests.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=16
R=/tmp/r48c; mkdir -p $R; cp .scratch/call48c.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0
save() { tar czf $OUT/call48c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_F PYTHONPATH=/tmp/site:$PWD python3 .scratch/s48/build.py F > $R/build_F.log 2>&1; tail -n 1 $R/build_F.log; echo "build ${SECONDS}s"
run() { KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_F PYTHONPATH=/tmp/site:$PWD "$@"; }
mkdir -p $R/rope; run timeout 280 python3 -m benchmarks.rope_write --quick --tokens 64,256,1024,2048,4096,16384 --out $R/rope > $R/rope/log.txt 2>&1; echo "rope rc=$? ${SECONDS}s"; save
run timeout 150 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "16bit_caches or unit_pairs" > $R/tests_F.txt 2>&1; echo "tests F rc=$? ${SECONDS}s"; tail -1 $R/tests_F.txt
save
grep '^|' $R/rope/log.txt | cut -c1-200
echo "done ${SECONDS}s"
