python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=4
R=$OUT/r; mkdir -p $R; cp .scratch/s22c2.sh $R/
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm --format=csv > $R/gpu.txt
declare -A FLAGS=( [base]="" [pp]="-DKVFUSE_PREFILL_FP8_PINGPONG=1" [pp_p2]="-DKVFUSE_PREFILL_FP8_PINGPONG=1 -DKVFUSE_PREFILL_FP8_POLY_EXP=2" [pp_p4]="-DKVFUSE_PREFILL_FP8_PINGPONG=1 -DKVFUSE_PREFILL_FP8_POLY_EXP=4" )
V="base pp pp_p2 pp_p4"
SECONDS=0
for v in $V; do
  KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('$v', i['built'], i['build_seconds'], i['error'])" > $R/build_$v.log 2>&1 &
done
wait; cat $R/build_*.log | tail -4; echo "builds ${SECONDS}s"
for round in 1 2; do
  for v in $V; do
    m=fp8; [ $round = 1 ] && [ $v = base ] && m=fp8,bf16
    KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" timeout 100 python3 .scratch/ab_prefill.py $v $m >> $R/ab.jsonl 2>>$R/ab_err_$v.log
    echo "$v ${SECONDS}s"
  done
done
python3 - $R/ab.jsonl <<'PY'
import json,sys,collections
d=collections.defaultdict(list)
for l in open(sys.argv[1]):
    r=json.loads(l); d[(r["mode"],r["case"],r["label"])].append(r["us"])
for k in sorted(d): print(*k, d[k])
PY
NCU=/usr/local/cuda/bin/ncu
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_base timeout 150 $NCU --section SourceCounters --section WarpStateStats --section SchedulerStats --section LaunchStats -k regex:prefill_attention_kernel -s 2 -c 1 -o $R/fp8_4096 -f python3 .scratch/prof_native.py 4096 fp8 > $R/ncu_run.log 2>&1; echo "ncu rc=$? ${SECONDS}s"; tail -3 $R/ncu_run.log
$NCU --import $R/fp8_4096.ncu-rep --page details > $R/ncu_details.txt 2>&1
$NCU --import $R/fp8_4096.ncu-rep --page source --csv --print-source sass > $R/ncu_source.csv 2> $R/ncu_source.err || $NCU --import $R/fp8_4096.ncu-rep --page source --csv > $R/ncu_source.csv 2>> $R/ncu_source.err
wc -c $R/ncu_source.csv; head -c 600 $R/ncu_source.csv; head -3 $R/ncu_source.err
grep -E "Warp Cycles Per Issued|Issue Slots|No Eligible|Stall" $R/ncu_details.txt | head -20
tar czf $OUT/s22c2.tgz -C $R . && rm -rf $R
