python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=8
R=$OUT/r; mkdir -p $R
declare -A FLAGS=( [base]="" [nopp]="-DKVFUSE_PREFILL_PINGPONG=0" )
SECONDS=0
for v in base nopp; do
  KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('$v', i['built'], i['build_seconds'], i['error'])" > $R/build_$v.log 2>&1 &
done
wait; cat $R/build_*.log | tail -4; echo "builds ${SECONDS}s"
for m in fp8 bf16; do
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_base timeout 100 /usr/local/cuda/bin/ncu --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,smsp__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active -k regex:prefill_attention_kernel -s 2 -c 1 python3 .scratch/prof_native.py 4096 $m > $R/ncu_stall_$m.txt 2>&1
echo "== $m"; grep -E "ratio|pct" $R/ncu_stall_$m.txt | awk '$NF+0 > 0.05' | sed 's/smsp__average_warps_issue_stalled_//' | head -30
done
echo "ncu ${SECONDS}s"
for round in 1 2; do
  for v in base nopp; do
    KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" timeout 100 python3 .scratch/ab_prefill.py $v fp8,bf16 >> $R/ab.jsonl 2>$R/ab_err_$v.log
  done
  echo "round $round ${SECONDS}s"
done
python3 - $R/ab.jsonl <<'PY'
import json,sys,collections
d=collections.defaultdict(list)
for l in open(sys.argv[1]):
    r=json.loads(l); d[(r["mode"],r["case"],r["label"])].append(r["us"])
for k in sorted(d): print(*k, d[k])
PY
tar czf $OUT/call5.tgz -C $R . && rm -rf $R
