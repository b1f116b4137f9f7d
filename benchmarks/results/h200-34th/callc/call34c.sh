# H200: the whole rotary write benchmark (issue 17: decode 64 and prefill 4096, every format and variant,
# FlashInfer's rope_quantize_fp8_append_paged_kv_cache), SM clock / power during bf16 and FP8 prefill (issue 16),
# and the rotary fusion GPU tests, on HEAD's source.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=16 BENCH_COMMIT=$(cat .scratch/commit)
R=/tmp/r; mkdir -p $R; cp .scratch/call34c.sh .scratch/clock_probe.py $R/
SECONDS=0
save() { tar czf $OUT/call34c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
export PYTHONPATH=/tmp/site:$PWD KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_new
python3 .scratch/s29/build.py new > $R/build_new.log 2>&1; tail -n 1 $R/build_new.log; echo "build ${SECONDS}s"
for m in bf16 fp8 bf16 fp8; do timeout 40 python3 .scratch/clock_probe.py new $m 16384 12 >> $R/clock.jsonl 2>>$R/clock.err || echo "clock $m rc=$?"; done
cat $R/clock.jsonl; echo "clock ${SECONDS}s"; save
mkdir -p $R/rope; timeout 260 python3 -m benchmarks.rope_write --quick --out $R/rope > $R/rope/log.txt 2>&1; echo "rope rc=$? ${SECONDS}s"
tail -n 14 $R/rope/log.txt; save
[ $SECONDS -lt 420 ] && { KVFUSE_FAILURE_LOG=$R/failures.txt timeout $((565 - SECONDS)) python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu -n 14 -rfE \
  tests/ops/test_rope_kv_write.py tests/compile/test_rope_fusion.py > $R/tests.log 2>&1; echo "pytest rc=$? ${SECONDS}s"; tail -n 2 $R/tests.log; }
save; echo "done ${SECONDS}s"
