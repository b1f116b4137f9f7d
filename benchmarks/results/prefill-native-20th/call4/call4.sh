python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=8
R=$OUT/r; mkdir -p $R
declare -A FLAGS=( [base]="" [st2]="-DKVFUSE_PREFILL_FP8_STAGES=2" [st4]="-DKVFUSE_PREFILL_FP8_STAGES=4" [hexp]="-DKVFUSE_PREFILL_FP8_HALF_EXP=1" )
SECONDS=0
for v in base st2 st4 hexp; do
  KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" python3 -c "from kvfuse.ops import native; i=native.build_info(build=True); print('$v', i['built'], i['build_seconds'], i['error'])" > $R/build_$v.log 2>&1 &
done
wait; cat $R/build_*.log | tail -8; echo "builds ${SECONDS}s"
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_hexp timeout 120 python3 -m pytest -q -p no:cacheprovider tests/ops/test_native_prefill.py -k "fp8 or sinks" 2>&1 | tail -3
for round in 1 2; do
  for v in base st2 st4 hexp; do
    KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" timeout 100 python3 .scratch/ab_prefill.py $v fp8 >> $R/ab.jsonl 2>$R/ab_err_$v.log
  done
  KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_base timeout 100 python3 .scratch/ab_prefill.py base bf16 >> $R/ab.jsonl 2>>$R/ab_err_bf16.log
  echo "round $round ${SECONDS}s"
done
python3 - $R/ab.jsonl <<'PY'
import json,sys,collections
d=collections.defaultdict(list)
for l in open(sys.argv[1]):
    r=json.loads(l); d[(r["mode"],r["case"],r["label"])].append(r["us"])
for k in sorted(d): print(*k, d[k])
PY
tar czf $OUT/call4.tgz -C $R . && rm -rf $R
