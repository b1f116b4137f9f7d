# Issue 17, 55th session call d (device time short after two refused starts). Build t (the tree:
# FP8 8-element rotary units take the one-product division and one NaN branch; FP8 unit pairs from
# 4096 units, 64 tokens of 8 x 128). GPU tests of the FP8 rotary writes (every division, bit-exact
# setups); bf16 at 64 tokens with the variants in reverse order, 3 rounds; FP8 at 32-1023 tokens,
# 2 rounds; then the unit-pair tests in the time left.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=16
R=/tmp/r55d; mkdir -p $R; cp .scratch/call55d.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call55d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
run() { (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_t PYTHONPATH=/tmp/site:$ROOT "$@"); }
run python3 $ROOT/.scratch/s55/build.py t > $R/build_t.log 2>&1; tail -qn 1 $R/build_t.log; echo "build ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "the build failed"; save; exit 1; fi
run timeout 170 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "every_division or native_bit_exact" > $R/pytest_t.txt 2>&1; echo "pytest t rc=$? ${SECONDS}s"; tail -n 2 $R/pytest_t.txt; save
VR="rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables;rope_k+write (native);write"
for r in 1 2 3; do d=$R/d64r/bt_$r; mkdir -p $d; run timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 64 --formats bfloat16 --variants "$VR" > $d/log.txt 2>&1; echo "d64r $r ${SECONDS}s"; done; save
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
for r in 1 2; do d=$R/fp8/bt_$r; mkdir -p $d; run timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 32,64,256,1023 --formats fp8 --variants "$VV" > $d/log.txt 2>&1; echo "fp8 $r ${SECONDS}s"; done; save
for g in fp8 d64r; do python3 .scratch/s55/summarize.py $R/$g > $R/${g}_summary.txt; cat $R/${g}_summary.txt; done
left=$((360 - SECONDS)); if [ $left -gt 40 ]; then run timeout $left python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "unit_pairs" > $R/pytest_pairs.txt 2>&1; echo "pytest pairs rc=$? ${SECONDS}s"; tail -n 2 $R/pytest_pairs.txt; fi
save; echo "done ${SECONDS}s"
