set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=4
R=$OUT/r; mkdir -p $R; cp .scratch/call2.sh .scratch/prof_nvfp4.py $R/
SECONDS=0
declare -A FL=( [stg3]="" [stg3late]="-DKVFUSE_DECODE_NVFP4_V_EARLY=0" [reg]="-DKVFUSE_DECODE_NVFP4_STAGES=0 -DKVFUSE_DECODE_NVFP4_V_EARLY=0" [stg4]="-DKVFUSE_DECODE_NVFP4_STAGES=4" )
for v in stg3late reg stg4; do
  KVFUSE_NATIVE_CUDA_FLAGS="${FL[$v]}" python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build $v:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build' &
done
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build stg3:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build'
wait
echo "builds at ${SECONDS}s"
timeout 170 python3 -m pytest -q -m gpu -n 8 tests/ops/test_native_attention.py -p no:cacheprovider --tb=short -x > $R/gpu_tests.log 2>&1
echo "pytest rc=$? at ${SECONDS}s"; tail -1 $R/gpu_tests.log; grep -E "^(FAILED|ERROR)" $R/gpu_tests.log | head -8
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 \
  --kernel-name kns=decode_attention python3 tests/ops/_native_attention_sanitize.py > $R/sanitizer_attention.log 2>&1
echo "memcheck rc=$? at ${SECONDS}s: $(tail -2 $R/sanitizer_attention.log | tr '\n' ' ')"
for round in 1 2; do
  for v in stg3 stg3late reg stg4; do
    KVFUSE_NATIVE_CUDA_FLAGS="${FL[$v]}" timeout 100 python3 -m benchmarks.attention --only decode --decode-cases 64:4096,16:16384 \
      --modes fp8,nvfp4 --impls kvfuse_native --out $R/${v}_$round > /dev/null 2>&1 || echo "bench $v failed"
  done
done
echo "benches at ${SECONDS}s"
for v in stg3 reg; do
  KVFUSE_NATIVE_CUDA_FLAGS="${FL[$v]}" timeout 100 ncu --profile-from-start off --clock-control none --metrics \
gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,launch__registers_per_thread \
    python3 .scratch/prof_nvfp4.py > $R/ncu_$v.txt 2>&1
  echo "== ncu $v"; grep -E "duration|dram__|inst_executed|issue_active|warps_active|conflicts|long_score|registers" $R/ncu_$v.txt | sed 's/  */ /g' | cut -c1-100
done
python3 - <<'PY'
import json, os
R = os.environ["OUT"] + "/r/"
for v in ("stg3", "stg3late", "reg", "stg4"):
    for rnd in (1, 2):
        try:
            d = json.load(open(f"{R}{v}_{rnd}/attention.json"))
        except Exception as e:
            print(v, rnd, "missing", e); continue
        print(v, rnd, "copy", round(d["copy_gb_per_s"]), [(r["kv_cache_dtype"], r["batch"], r["context"], r["us"]) for r in d["rows"]])
PY
tar czf $OUT/call2.tgz -C $R . && rm -rf $R
