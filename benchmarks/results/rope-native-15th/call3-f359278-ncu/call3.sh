set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=8
R=$OUT/results; mkdir -p $R; cp .scratch/call3.sh .scratch/prof_rope.py $R/
V1="-DKVFUSE_FP8_UNITS=2 -DKVFUSE_WIDE_GRID=256"
for flags in "" "$V1"; do
  KVFUSE_NATIVE_CUDA_FLAGS="$flags" python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build ${flags:-default}:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build ' &
done
wait
SECONDS=0
for rep in 1 2; do
for flags in "" "$V1"; do
  tag=$(printf '%s' "${flags:-default}" | tr -c 'A-Za-z0-9_' '_')_$rep; mkdir -p $R/b_$tag
  echo "== ${flags:-default} rep $rep"
  KVFUSE_NATIVE_CUDA_FLAGS="$flags" timeout 100 python3 -m benchmarks.rope_write --quick --out $R/b_$tag --tokens 1024,4096,16384 \
    --formats fp8,nvfp4 --variants "write;rope_k+write (native);rope_k+write (triton)" 2>&1 | grep -E '^\| [0-9]|differ'
done; done
echo "benches done at ${SECONDS}s"
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld_lookup_hit.sum,smsp__inst_executed.sum,lts__t_sector_hit_rate.pct
for c in "fp8 4096" "nvfp4 4096"; do
  set -- $c
  timeout 90 ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \
    --section SchedulerStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --metrics $M \
    -o $R/rep_$1_$2 python3 .scratch/prof_rope.py $1 $2 > $R/ncu_log_$1_$2.txt 2>&1
  echo "ncu $c rc=$?"
  ncu -i $R/rep_$1_$2.ncu-rep --page details > $R/ncu_$1_$2.txt 2>&1
  ncu -i $R/rep_$1_$2.ncu-rep --page raw --csv > $R/raw_$1_$2.csv 2>&1
done
python3 - <<'PY'
import os, re
R = os.environ["OUT"] + "/results/"
keys = ["Duration", "Memory Throughput", "DRAM Throughput", "L1/TEX Hit Rate", "L2 Hit Rate", "Compute (SM) Throughput",
        "Issue Slots Busy", "Achieved Occupancy", "Registers Per Thread", "Warp Cycles Per Issued Instruction",
        "Theoretical Occupancy", "smsp__inst_executed.sum", "lts__t_sectors_srcunit_tex_op_read.sum",
        "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum", "l1tex__t_sectors_pipe_lsu_mem_global_op_ld_lookup_hit.sum",
        "L2 Cache Throughput", "L1/TEX Cache Throughput", "Mem Busy", "Max Bandwidth", "Mem Pipes Busy"]
for f in sorted(os.listdir(R)):
    if not f.startswith("ncu_"): continue
    print("==", f)
    for block in re.split(r"\n  (?=[a-zA-Z_])", open(R + f).read())[1:]:
        print(block.splitlines()[0][:90])
        for k in keys:
            m = re.search(r"^\s+" + re.escape(k) + r"\s+(\S+)?\s+([\d.,]+)\s*$", block, re.M)
            if m: print(f"    {k}: {m.group(2)} {m.group(1) or ''}")
PY
python3 - <<'PY'
import csv, os
R = os.environ["OUT"] + "/results/"
for f in sorted(os.listdir(R)):
    if not f.startswith("raw_"): continue
    rows = list(csv.reader(open(R + f)))
    head = rows[0]
    print("==", f, len(rows) - 2, "kernels")
    for r in rows[2:]:
        d = dict(zip(head, r))
        st = {k.split("stalled_")[1].split("_per")[0]: float(v.replace(",", "")) for k, v in d.items()
              if k.startswith("smsp__average_warps_issue_stalled_") and k.endswith("per_issue_active.ratio") and v}
        top = sorted(st.items(), key=lambda kv: -kv[1])[:6]
        print(d.get("Kernel Name", "")[:60], " ".join(f"{k}={v:.2f}" for k, v in top))
PY
