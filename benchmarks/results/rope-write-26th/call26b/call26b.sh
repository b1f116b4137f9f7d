set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KVFUSE_NATIVE_BUILD_DIR=/tmp/kvb BENCH_COMMIT=$(cat .scratch/commit)
R=$OUT/r; mkdir -p $R; cp .scratch/call26b.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid --format=csv | tee $R/gpu.csv
# 0 default (unit pairs) | 1 single units (before) | 2 pairs + streaming hint on 8-byte FP8 stores
V=("" "-DKVFUSE_ROPE_PAIR_UNITS=0" "-DKVFUSE_NARROW_STORE_HINT=1")
for i in 0 1 2; do
  KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" MAX_JOBS=5 python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build $i:', i.get('built'), i.get('build_seconds'), str(i.get('error'))[:1500])" 2>&1 | grep -A10 '^build' &
done; wait
echo "builds done at ${SECONDS}s"
M=gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_requests_pipe_lsu_mem_global_op_st.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum,lts__t_sectors_op_write.sum,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio
for i in 0 1; do for fmt in fp8 nvfp4; do
  KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" timeout 100 ncu --metrics $M --cache-control none --clock-control none -k regex:rows_kernel --launch-skip 14 --launch-count 14 \
    --csv --page raw python3 .scratch/ncu_target.py $fmt 4096 > $R/ncu_${i}_$fmt.csv 2> $R/ncu_${i}_$fmt.err || echo "ncu $i $fmt rc=$?"
done; done
echo "ncu done at ${SECONDS}s"
python3 .scratch/summarize26b.py $R
VV="write;rope_k+write (native);rope_k+write (native), f32 half tables"
for rep in 1 2; do for i in 0 1 2; do
  d=$R/b${i}_$rep; mkdir -p $d
  KVFUSE_NATIVE_CUDA_FLAGS="${V[$i]}" timeout 60 python3 -m benchmarks.rope_write --quick --out $d --tokens 1024,4096,16384 \
    --formats fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "bench $d rc=$?"
  [ $SECONDS -gt 540 ] && break 2
done; echo "round $rep done at ${SECONDS}s"; done
grep -h "differ" $R/*/log.txt | sort | uniq -c | head -8
python3 .scratch/summarize25.py $R
tar czf $OUT/call26b.tgz -C $R . && rm -rf $R
