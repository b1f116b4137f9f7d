# Issue 17, 57th session call a: where the FP8 rotary write of 64 tokens spends its extra time.
# ncu on HEAD's kernels: durations, instructions and warp states of the write alone and the
# rotary write (three table forms) at 64 and 4096 tokens; PC-sampled stalls per SASS line at 64
# tokens. Then the benchmarks' GPU tests and the one-by-one bench path (6e3b9e1, not yet GPU-run).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r57a; mkdir -p $R; cp .scratch/call57a.sh .scratch/s57/ncu_probe.py $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call57a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
ncu --version | tail -1
run() { (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_h PYTHONPATH=/tmp/site:$ROOT "$@"); }
run python3 $ROOT/.scratch/s56/build.py h > $R/build_h.log 2>&1; tail -n 1 $R/build_h.log; echo "build ${SECONDS}s"
if grep -l "unavailable" $R/build_h.log; then save; exit 1; fi
M=gpu__time_duration.sum,sm__cycles_elapsed.max,smsp__inst_executed.sum,smsp__cycles_active.max,launch__registers_per_thread,launch__grid_size,launch__block_size,smsp__warps_launched.sum
for tk in 64 4096; do for w in write full bhalf fhalf; do
  run timeout 60 ncu --clock-control none --metrics $M -k regex:rows_kernel --launch-skip 16 --launch-count 6 python3 .scratch/s57/ncu_probe.py $w 4 $tk fp8 > $R/ncu_${tk}_$w.txt 2>&1
  echo "ncu $tk $w rc=$? ${SECONDS}s"; done; done; save
for w in write full fhalf; do
  run timeout 90 ncu --clock-control none --set none --section WarpStateStats --section SourceCounters --section LaunchStats --warp-sampling-interval 0 -k regex:rows_kernel --launch-skip 16 --launch-count 3 -o $R/src64_$w python3 .scratch/s57/ncu_probe.py $w 4 64 fp8 > $R/src64_$w.log 2>&1
  echo "src $w rc=$? ${SECONDS}s"
  ncu -i $R/src64_$w.ncu-rep --page details --print-details all > $R/src64_${w}_details.txt 2>&1
  ncu -i $R/src64_$w.ncu-rep --page source --csv --print-source sass > $R/src64_${w}_sass.csv 2>&1; echo "print rc=$?"
done; save
python3 - $R <<'PY' | tee $R/ncu_summary.txt
import sys, glob, os, re, statistics
for f in sorted(glob.glob(sys.argv[1] + "/ncu_*_*.txt")):
    vals, names = {}, set()
    for line in open(f):
        if "rows_kernel" in line: names.add(line.strip()[:160])
        p = line.split()
        if len(p) >= 3 and re.match(r"^[a-z_]+__", p[0]):
            vals.setdefault(p[0], []).append(float(p[-1].replace(",", "")))
    print(os.path.basename(f)[4:-4], " ".join(f"{k.split('__')[1][:22]}={statistics.median(v):g}" for k, v in vals.items()))
    for n in sorted(names): print("   ", n)
PY
run timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_benchmarks_common.py tests/test_benchmarks_rope_write.py > $R/tests.txt 2>&1; echo "tests rc=$? ${SECONDS}s"; tail -2 $R/tests.txt
run timeout 100 python3 -m benchmarks.rope_write --quick --out $R/bench_path --tokens 64,4096 --formats fp8 > $R/bench_path.txt 2>&1; echo "bench path rc=$? ${SECONDS}s"; tail -8 $R/bench_path.txt
save; echo "done ${SECONDS}s"
