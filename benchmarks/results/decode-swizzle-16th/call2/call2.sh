set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=8
R=$OUT/r; mkdir -p $R; cp .scratch/call2.sh $R/
SECONDS=0
OLD="-DKVFUSE_DECODE_FP8_SWIZZLE=0"
KVFUSE_NATIVE_CUDA_FLAGS="$OLD" python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build old:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build' &
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build swz:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build'
wait
echo "builds at ${SECONDS}s"
timeout 200 python3 -m pytest -q -m gpu -n 8 tests/ops/test_native_attention.py -p no:cacheprovider --tb=short > $R/gpu_tests.log 2>&1
echo "pytest rc=$? at ${SECONDS}s"; tail -1 $R/gpu_tests.log; grep -E "^(FAILED|ERROR)" $R/gpu_tests.log | head -8
for round in 1 2; do
  for v in swz old; do
    F=""; [ $v = old ] && F="$OLD"
    KVFUSE_NATIVE_CUDA_FLAGS="$F" timeout 100 python3 -m benchmarks.attention --only decode --decode-cases 64:4096,16:16384 \
      --modes fp8 --impls kvfuse_native --out $R/${v}_$round > /dev/null 2>&1 || echo "bench $v failed"
  done
done
echo "benches at ${SECONDS}s"
for v in swz old; do
  F=""; [ $v = old ] && F="$OLD"
  KVFUSE_NATIVE_CUDA_FLAGS="$F" timeout 100 ncu --profile-from-start off --clock-control none --metrics \
gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read.sum,smsp__sass_l1tex_m_xbar2l1tex_read_sectors_mem_global_op_ldgsts_cache_bypass.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,smsp__inst_executed.sum,lts__t_sector_hit_rate.pct,lts__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread \
    python3 .scratch/prof_dec_fp8.py > $R/ncu_$v.txt 2>&1
  echo "== ncu $v"; grep -E "decode_attention|duration|dram__|lts__|xbar|wavefronts|conflicts|inst_executed|registers" $R/ncu_$v.txt | sed 's/  */ /g' | cut -c1-120
done
python3 - <<'PY'
import json, os
R = os.environ["OUT"] + "/r/"
for v in ("swz", "old"):
    for rnd in (1, 2):
        d = json.load(open(f"{R}{v}_{rnd}/attention.json"))
        print(v, rnd, "copy", round(d["copy_gb_per_s"]), [(r["batch"], r["context"], r["us"], r["frac_of_copy"]) for r in d["rows"]])
PY
tar czf $OUT/call2.tgz -C $R . && rm -rf $R
