python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=4
R=$OUT/r; mkdir -p $R; cp .scratch/s22c1.sh $R/
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm --format=csv > $R/gpu.txt
V="p0 p2 p3 p4 p6"
SECONDS=0
for v in $V; do
  KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="-DKVFUSE_PREFILL_FP8_POLY_EXP=${v#p}" python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('$v', i['built'], i['build_seconds'], i['error'])" > $R/build_$v.log 2>&1 &
done
wait; cat $R/build_*.log | tail -5; echo "builds ${SECONDS}s"
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_p2 KVFUSE_NATIVE_CUDA_FLAGS="-DKVFUSE_PREFILL_FP8_POLY_EXP=2" timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_native_prefill.py > $R/tests_native_prefill_p2.log 2>&1; tail -2 $R/tests_native_prefill_p2.log
echo "tests ${SECONDS}s"
for round in 1 2; do
  for v in $V; do
    m=fp8; [ $round = 1 ] && [ $v = p0 ] && m=fp8,bf16
    KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="-DKVFUSE_PREFILL_FP8_POLY_EXP=${v#p}" timeout 100 python3 .scratch/ab_prefill.py $v $m >> $R/ab.jsonl 2>>$R/ab_err_$v.log
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
tar czf $OUT/s22c1.tgz -C $R . && rm -rf $R
