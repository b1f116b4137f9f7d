set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$(cat .scratch/commit)
R=$OUT/r; mkdir -p $R; cp .scratch/call29a.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid --format=csv | tee $R/gpu.csv
ncu --version | tail -1
# 0 default | 1 rotary writes with K and V units in separate threads (unpaired) at every size
V=("" "-DKVFUSE_ROPE_UNPAIRED_BELOW=1073741824")
for i in 0 1; do
  KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$i KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" MAX_JOBS=8 python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build $i:', i.get('built'), i.get('build_seconds'), str(i.get('error'))[:1500])" 2>&1 | grep -A10 '^build' &
done; wait
echo "builds done at ${SECONDS}s"
export KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_0
for m in fp8 bf16; do
  timeout 120 ncu --section SourceCounters --section WarpStateStats --section SchedulerStats --section SpeedOfLight \
    --section Occupancy --section LaunchStats --cache-control none --clock-control none -k regex:prefill_attention_kernel \
    --launch-skip 1 --launch-count 1 -f -o $R/pf_$m python3 .scratch/s29/ncu_prefill.py $m 16384 > $R/pf_$m.log 2>&1 || echo "ncu pf $m rc=$?"
  ncu -i $R/pf_$m.ncu-rep --page source --print-source sass --csv > $R/pf_${m}_sass.csv 2> $R/pf_${m}_sass.err || \
    ncu -i $R/pf_$m.ncu-rep --page source --csv > $R/pf_${m}_sass.csv 2>> $R/pf_${m}_sass.err
  ncu -i $R/pf_$m.ncu-rep --page details --csv > $R/pf_${m}_details.csv 2>&1
  echo "ncu pf $m done at ${SECONDS}s: $(wc -c < $R/pf_${m}_sass.csv) bytes of sass csv"
done
M=gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,launch__waves_per_multiprocessor,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio
for i in 0 1; do for fmt in nvfp4; do
  KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$i KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" timeout 100 ncu --metrics $M --cache-control none --clock-control none -k regex:rows_kernel --launch-skip 14 --launch-count 14 \
    --csv --page raw python3 .scratch/s29/ncu_rope.py $fmt 4096 "f32 half" > $R/ncu_${i}_$fmt.csv 2> $R/ncu_${i}_$fmt.err || echo "ncu $i $fmt rc=$?"
done; done
echo "ncu rope done at ${SECONDS}s"
python3 .scratch/summarize26b.py $R 2>&1 | grep -v "device__\|nvlink\|numa\|profiler__\|c2c\|launch__\(cluster\|occupancy_per\|shared\|func\|uses\|tpc\|stream\|context\|device\|sm_count\|block_dim\|grid_dim\|stack\|persisting\|barrier\|kernel_name\|thread_count\)" | head -60
VV="write;rope_k+write (native);rope_k+write (native), f32 half tables"
for rep in 1 2; do for i in 0 1; do
  d=$R/b${i}_$rep; mkdir -p $d
  KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$i KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 4096,16384 \
    --formats fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1 || echo "bench $d rc=$?"
  [ $SECONDS -gt 540 ] && break 2
done; echo "round $rep done at ${SECONDS}s"; done
grep -h "differ" $R/*/log.txt | sort | uniq -c | head -8
python3 .scratch/summarize26.py $R
rm -f $R/*.ncu-rep.tmp
tar czf $OUT/call29a.tgz -C $R . && rm -rf $R
