python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=3
R=$OUT/r; mkdir -p $R; cp .scratch/s22c4.sh $R/
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm --format=csv > $R/gpu.txt
declare -A FLAGS=( [k128_l0]="-DKVFUSE_PREFILL_FP8_KEYS=128 -DKVFUSE_PREFILL_FP8_LATE_STEPS=0" [k192_l1]="-DKVFUSE_PREFILL_FP8_LATE_STEPS=1" [k192_l2]="-DKVFUSE_PREFILL_FP8_LATE_STEPS=2" [k192_l3]="-DKVFUSE_PREFILL_FP8_LATE_STEPS=3" [k192_l6]="-DKVFUSE_PREFILL_FP8_LATE_STEPS=6" )
V="k128_l0 k192_l1 k192_l2 k192_l3 k192_l6"
SECONDS=0
for v in $V; do
  KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('$v', i['built'], i['build_seconds'], i['error'])" > $R/build_$v.log 2>&1 &
done
wait; cat $R/build_*.log | tail -5; echo "builds ${SECONDS}s"
for round in 1 2; do
  for v in $V; do
    m=fp8; [ $round = 1 ] && [ $v = k128_l0 ] && m=fp8,bf16
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
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_k192_l2 KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[k192_l2]}" timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_native_prefill.py > $R/tests_native_prefill_k192_l2.log 2>&1; tail -1 $R/tests_native_prefill_k192_l2.log
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_k192_l1 KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[k192_l1]}" timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_native_prefill.py > $R/tests_native_prefill_k192_l1.log 2>&1; tail -1 $R/tests_native_prefill_k192_l1.log
echo "tests ${SECONDS}s"
tar czf $OUT/s22c4.tgz -C $R . && rm -rf $R
