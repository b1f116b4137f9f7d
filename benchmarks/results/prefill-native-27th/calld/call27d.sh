set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=8
W=$PWD; R=$OUT/r; mkdir -p $R; cp .scratch/call27d.sh .scratch/promote_probe.py $R/
SECONDS=0
nvidia-smi --query-gpu=name,uuid,clocks.sm,clocks.max.sm --format=csv > $R/gpu.csv
declare -A FLAGS=( [old]="-DKVFUSE_PREFILL_FP8_PROMOTE=0" [new]="" )
V="old new"
for v in $V; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('$v', i['built'], i['build_seconds'], str(i['error'])[:1500])" > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"
env_of() { echo KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$1 KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$1]}"; }
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_new KVFUSE_FAILURE_LOG=$R/failures.txt timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu -n 12 tests/ops/test_native_prefill.py > $R/tests_native_prefill.log 2>&1; echo "tests new rc=$? $(tail -n 1 $R/tests_native_prefill.log) ${SECONDS}s"; head -c 1200 $R/failures.txt 2>/dev/null
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_old KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[old]}" timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/ops/test_native_prefill.py -k constant_values > $R/tests_constant_old.log 2>&1; echo "constant-value tests on old rc=$? $(tail -n 1 $R/tests_constant_old.log)"
for round in 1 2; do
  for v in $V; do
    m=fp8; [ $round = 1 ] && m=fp8,bf16
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
for v in $V; do
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" timeout 100 python3 .scratch/promote_probe.py $v >> $R/probe.jsonl 2>$R/probe_err_$v.log; echo "probe $v rc=$? ${SECONDS}s"
done
cut -c1-220 $R/probe.jsonl
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_new PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 60 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 --kernel-name kns=prefill_attention python3 tests/ops/_native_prefill_sanitize.py > $R/memcheck.log 2>&1; echo "memcheck rc=$? ${SECONDS}s"; tail -n 1 $R/memcheck.log
tar czf $OUT/call27d.tgz -C $R . && rm -rf $R
