# Issue 16 at 7273653: compute-sanitizer memcheck over the native prefill cases (e4m3 now stores O by tensor maps),
# and SM clock / power while one 16384-token prefill runs back to back (bf16 and FP8, 12 s each, alternating).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=16
R=/tmp/r; rm -rf $R; mkdir -p $R; cp .scratch/call42e.sh .scratch/s42/clock_probe.py $R/; git log --oneline -1 > $R/commit.txt
save() { tar czf $OUT/call42e.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
SECONDS=0
python3 .scratch/s29/build.py head > $R/build.log 2>&1; tail -1 $R/build.log; echo "build ${SECONDS}s"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/ops/_native_prefill_sanitize.py > $R/sanitizer_prefill.log 2>&1
echo "memcheck rc=$? $(grep -c 'ERROR SUMMARY: 0 errors' $R/sanitizer_prefill.log) clean; $(tail -2 $R/sanitizer_prefill.log | tr '\n' ' ') ${SECONDS}s"; save
for m in bf16 fp8 bf16 fp8; do timeout 40 python3 .scratch/s42/clock_probe.py run $m 16384 12 >> $R/clock.jsonl 2>>$R/clock.err; echo "$m ${SECONDS}s"; done
cat $R/clock.jsonl; save; echo "done ${SECONDS}s"
