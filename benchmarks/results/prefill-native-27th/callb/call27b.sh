set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=4
W=$PWD; R=$OUT/r; mkdir -p $R; cp .scratch/call27b.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid,clocks.sm,clocks.max.sm --format=csv | tee $R/gpu.csv
declare -A FLAGS=( [old]="-DKVFUSE_PREFILL_FP8_TC_ROWSUM=0 -DKVFUSE_PREFILL_FP8_DESC_WORDS=0" [tc]="-DKVFUSE_PREFILL_FP8_DESC_WORDS=0" [tcd]="" [tcdl]="-DKVFUSE_PREFILL_FP8_RESCALE_AFTER_S=1" )
V="old tc tcd tcdl"
for v in $V; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('$v', i['built'], i['build_seconds'], str(i['error'])[:1500])" > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"
for v in tcd tcdl; do
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/ops/test_native_prefill.py > $R/tests_native_prefill_$v.log 2>&1; echo "$v native_prefill rc=$?: $(tail -n 1 $R/tests_native_prefill_$v.log)"
done
echo "tests ${SECONDS}s"
for round in 1 2 3; do
  for v in $V; do
    m=fp8; [ $round = 2 ] && m=fp8,bf16
    KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" timeout 100 python3 .scratch/ab_prefill.py $v $m >> $R/ab.jsonl 2>>$R/ab_err_$v.log
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
for v in tcdl tcd; do
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 60 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 --kernel-name kns=prefill_attention python3 tests/ops/_native_prefill_sanitize.py > $R/memcheck_$v.log 2>&1; echo "memcheck $v rc=$? ${SECONDS}s"; tail -n 1 $R/memcheck_$v.log
done
tar czf $OUT/call27b.tgz -C $R . && rm -rf $R
