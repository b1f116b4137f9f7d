set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R; cp .scratch/call1.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid,pci.bus_id,clocks.max.sm,driver_version --format=csv | tee $R/gpu.csv
# 0 default | 1 carveout max L1 | 2 table L1 evict_last | 3 row loads L1 no_allocate
V=("" "-DKVFUSE_ROWS_CARVEOUT=0" "-DKVFUSE_ROPE_TABLE_L1_EVICT_LAST=1" "-DKVFUSE_LOAD_L1_NO_ALLOCATE=1")
for i in 0 1 2 3; do
  KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" MAX_JOBS=4 python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build $i:', i.get('built'), i.get('build_seconds'), str(i.get('error'))[:1500])" 2>&1 | grep -A20 '^build' &
done; wait
echo "builds done at ${SECONDS}s"
bench() { for i in 0 1 2 3; do
  d=b${i}_$1; mkdir -p $R/$d
  KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" timeout 100 python3 -m benchmarks.rope_write --quick --out $R/$d --tokens 2048,4096,8192,16384 \
    --formats fp8,nvfp4 --variants "write;rope_k+write (native)" > $R/$d/log.txt 2>&1 || echo "bench $d failed"
done; echo "bench round $1 done at ${SECONDS}s"; }
bench 1
M=gpu__time_duration.sum,launch__shared_mem_config_size,launch__registers_per_thread,launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_op_read_hit_rate.pct,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld_lookup_hit.sum,l1tex__t_sector_pipe_lsu_mem_global_op_ld_hit_rate.pct,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio
for fmt in fp8 nvfp4; do
  timeout 120 ncu --metrics $M --cache-control none --clock-control none -k regex:rows_kernel --launch-skip 14 --launch-count 14 \
    --csv --page raw python3 .scratch/ncu_target.py $fmt 4096 > $R/ncu_$fmt.csv 2> $R/ncu_$fmt.err || echo "ncu $fmt rc=$?"
done
echo "ncu done at ${SECONDS}s"
python3 .scratch/summarize1.py $R; tar czf $OUT/call1_partial.tgz -C $R .
bench 2; grep -h "differ" $R/*/log.txt | head -8
python3 .scratch/summarize1.py $R
tar czf $OUT/call1.tgz -C $R . && rm -rf $R
