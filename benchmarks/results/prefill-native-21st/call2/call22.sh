python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=5
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm --format=csv > $R/gpu.txt
declare -A FLAGS=( [base]="" [late]="-DKVFUSE_PREFILL_LATE_RESCALE=1" [tree]="-DKVFUSE_PREFILL_TREE_REDUCE=1" [both]="-DKVFUSE_PREFILL_LATE_RESCALE=1 -DKVFUSE_PREFILL_TREE_REDUCE=1" )
SECONDS=0
for v in base late tree both; do
  KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('$v', i['built'], i['build_seconds'], i['error'])" > $R/build_$v.log 2>&1 &
done
wait; cat $R/build_*.log | tail -4; echo "builds ${SECONDS}s"
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_both KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[both]}" timeout 90 python3 -m pytest -q -p no:cacheprovider tests/ops/test_native_prefill.py > $R/tests_native_prefill_both.log 2>&1; tail -2 $R/tests_native_prefill_both.log
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_late KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[late]}" timeout 60 python3 -m pytest -q -p no:cacheprovider tests/ops/test_native_prefill.py -k "fp8 or sinks or large or short" > $R/tests_native_prefill_late.log 2>&1; tail -1 $R/tests_native_prefill_late.log
echo "tests ${SECONDS}s"
for round in 1 2 3; do
  for v in base late tree both; do
    m=fp8,bf16; [ $round = 3 ] && m=fp8
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
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_base PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 --kernel-name kns=prefill_attention python3 tests/ops/_native_prefill_sanitize.py > $R/memcheck.log 2>&1; echo "memcheck rc=$? ${SECONDS}s"; tail -3 $R/memcheck.log
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_base timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 tests/models tests/compile tests/integrations tests/ops/test_per_token_head.py --deselect tests/compile/test_rope_fusion.py > $R/tests_models.log 2>&1; tail -2 $R/tests_models.log; echo "models ${SECONDS}s"
tar czf $OUT/call22.tgz -C $R . && rm -rf $R
