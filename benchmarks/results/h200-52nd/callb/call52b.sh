# Issue 17, 52nd session call b: the tree (t: biased E2M1 codes + packed amax) against HEAD (h):
# ncu's executed instructions and times of the NVFP4 write alone and the rotary write at 4096 tokens;
# rotary write rounds at 64/2048/4096/16384 tokens; the GPU tests of NVFP4 in the two write files.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r52b; mkdir -p $R; cp .scratch/call52b.sh .scratch/s52/ncu_probe.py $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call52b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/base && git archive HEAD | tar -x -C /tmp/base && mkdir -p /tmp/base/.scratch/s52 && cp .scratch/s52/ncu_probe.py /tmp/base/.scratch/s52/
declare -A DIR=( [h]=/tmp/base [t]=$PWD )
for v in h t; do
  (cd ${DIR[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v PYTHONPATH=/tmp/site:${DIR[$v]} python3 $ROOT/.scratch/s52/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; (cd ${DIR[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v PYTHONPATH=/tmp/site:${DIR[$v]} "$@"); }
M=gpu__time_duration.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__grid_size,launch__block_size
for v in h t; do for w in write full bhalf fhalf; do
  run $v timeout 60 ncu --clock-control none --metrics $M -k regex:rows_kernel --launch-skip 16 --launch-count 4 python3 .scratch/s52/ncu_probe.py $w 4 4096 > $R/ncu_${v}_$w.txt 2>&1
  echo "ncu $v $w rc=$? ${SECONDS}s"; done; done; save
python3 - $R <<'PY' | tee $R/ncu_summary.txt
import sys, glob, os, re, statistics
for f in sorted(glob.glob(sys.argv[1] + "/ncu_*_*.txt")):
    vals = {}
    for line in open(f):
        p = line.split()
        if len(p) >= 3 and re.match(r"^[a-z_]+__", p[0]):
            vals.setdefault(p[0], []).append(float(p[-1].replace(",", "")))
    print(os.path.basename(f)[4:-4], " ".join(f"{k.split('__')[1][:22]}={statistics.median(v):g}" for k, v in vals.items()))
PY
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
bench() { v=$1; r=$2; d=$R/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --quick --out $d --tokens 64,2048,4096,16384 --formats nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "rope $v $r ${SECONDS}s"; }
for v in h t; do bench $v 1; done; for v in t h; do bench $v 2; done; bench h 3; bench t 3
python3 .scratch/s52/summarize.py $R > $R/rope_summary.txt; cat $R/rope_summary.txt; save
left=$((590 - SECONDS))
run t timeout $left python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_native.py tests/ops/test_rope_kv_write.py -k "nvfp4 or NVFP4" > $R/tests.txt 2>&1; echo "tests rc=$? ${SECONDS}s"
grep -E "passed|failed|error" $R/tests.txt | tail -3; grep -E "^FAILED|^ERROR" $R/tests.txt | head -20
save; echo "done ${SECONDS}s"
