python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=5
W=$PWD
R=$OUT/r; mkdir -p $R /tmp/old; cp .scratch/s22c3.sh $R/; tar xf .scratch/old.tar -C /tmp/old
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm --format=csv > $R/gpu.txt
declare -A FLAGS=( [k192]="" [k128]="-DKVFUSE_PREFILL_FP8_KEYS=128" [old]="" )
declare -A TREE=( [k192]=$W [k128]=$W [old]=/tmp/old )
V="old k128 k192"
SECONDS=0
for v in $V; do
  (cd ${TREE[$v]} && PYTHONPATH=/tmp/site:${TREE[$v]} KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('$v', i['built'], i['build_seconds'], i['error'])" > $R/build_$v.log 2>&1) &
done
wait; cat $R/build_*.log | tail -3; echo "builds ${SECONDS}s"
export PYTHONPATH=/tmp/site:$W
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_k192 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_native_prefill.py > $R/tests_native_prefill_k192.log 2>&1; tail -2 $R/tests_native_prefill_k192.log
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_k192 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_quantized_prefill.py -k "native or fp8 or FP8" > $R/tests_quantized_prefill_k192.log 2>&1; tail -2 $R/tests_quantized_prefill_k192.log
echo "tests ${SECONDS}s"
for round in 1 2; do
  for v in $V; do
    m=fp8; [ $round = 1 ] && m=fp8,bf16
    (cd ${TREE[$v]} && PYTHONPATH=/tmp/site:${TREE[$v]} KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" timeout 100 python3 $W/.scratch/ab_prefill.py $v $m >> $R/ab.jsonl 2>>$R/ab_err_$v.log)
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
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_k192 PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 --kernel-name kns=prefill_attention python3 tests/ops/_native_prefill_sanitize.py > $R/memcheck.log 2>&1; echo "memcheck rc=$? ${SECONDS}s"; tail -3 $R/memcheck.log
tar czf $OUT/s22c3.tgz -C $R . && rm -rf $R
