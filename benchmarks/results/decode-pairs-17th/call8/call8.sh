set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=3
R=$OUT/r; mkdir -p $R; cp .scratch/call8.sh .scratch/ab_nvfp4.py $R/
SECONDS=0
declare -A FL=( [base]="" [mb2]="-DKVFUSE_DECODE_NVFP4_GROUP_MIN_BLOCKS=2" [mb3]="-DKVFUSE_DECODE_NVFP4_GROUP_MIN_BLOCKS=3" [st2]="-DKVFUSE_DECODE_NVFP4_STAGES=2" [st4]="-DKVFUSE_DECODE_NVFP4_STAGES=4" )
for v in mb2 mb3 st2 st4; do
  KVFUSE_NATIVE_CUDA_FLAGS="${FL[$v]}" python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build $v:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build' &
done
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build base:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build'
wait
echo "builds at ${SECONDS}s"
for round in 1 2; do
  for v in base mb2 mb3 st2 st4; do
    KVFUSE_NATIVE_CUDA_FLAGS="${FL[$v]}" timeout 60 python3 .scratch/ab_nvfp4.py $R/${v}_$round.json 1 4 nvfp4 > $R/${v}_$round.log 2>&1 || echo "ab $v failed"
  done
done
echo "ab at ${SECONDS}s"
python3 - <<'PY'
import json, os
R = os.environ["OUT"] + "/r/"
for v in ("base", "mb2", "mb3", "st2", "st4"):
    for rnd in (1, 2):
        try:
            d = json.load(open(f"{R}{v}_{rnd}.json"))
        except Exception as e:
            print(v, rnd, "missing", e); continue
        print(v, rnd, "copy", round(d["copy_gb_per_s"]), [(r["mode"], r["batch"], r["splits"], r["us"]) for r in d["rows"]])
PY
tar czf $OUT/call8.tgz -C $R . && rm -rf $R
