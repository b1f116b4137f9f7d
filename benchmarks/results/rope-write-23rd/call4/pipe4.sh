set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/pipe4.sh $R/
SECONDS=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active --format=csv > $R/smi_start.csv 2>&1; cat $R/smi_start.csv
python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), str(i.get('error'))[:2000])" 2>&1 | grep -A20 '^build'
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 250 > $R/smi_log.csv 2>&1 &
SMI=$!
V="write;rope_k+write (native);rope_k+write (triton)"
for d in q1 q2; do mkdir -p $R/$d; echo "$d start ${SECONDS}s" >> $R/marks.txt
  timeout 100 python3 -m benchmarks.rope_write --quick --out $R/$d --tokens 4096 --formats fp8,nvfp4 --variants "$V" > $R/$d/log.txt 2>&1; done
mkdir -p $R/full; echo "full start ${SECONDS}s" >> $R/marks.txt
timeout 250 python3 -m benchmarks.rope_write --out $R/full > $R/full/log.txt 2>&1; echo "full rc=$? at ${SECONDS}s"
for d in q3; do mkdir -p $R/$d; echo "$d start ${SECONDS}s" >> $R/marks.txt
  timeout 100 python3 -m benchmarks.rope_write --quick --out $R/$d --tokens 4096 --formats fp8,nvfp4 --variants "$V" > $R/$d/log.txt 2>&1; done
mkdir -p $R/fullq; echo "full-variants quick start ${SECONDS}s" >> $R/marks.txt
timeout 100 python3 -m benchmarks.rope_write --quick --out $R/fullq --tokens 4096 --formats fp8,nvfp4 > $R/fullq/log.txt 2>&1
kill $SMI
python3 - <<'PY'
import json, os
R = os.environ["OUT"] + "/r/"
for tag in ("q1", "q2", "full", "q3", "fullq"):
    try: rows = json.load(open(f"{R}{tag}/rope_write.json"))["rows"]
    except Exception as e: print(tag, e); continue
    for r in rows:
        if r["tokens"] != 4096 or r["format"] == "bfloat16": continue
        g = lambda k: r.get(k) if r.get(k) is not None else float("nan")
        print(f"{tag:5s} {r['format']:5s} write {g('write'):6.2f} native {g('rope_k+write (native)'):6.2f} ({g('rope_k+write (native)')/g('write'):.3f}) triton {g('rope_k+write (triton)'):6.2f} op {g('rope_k+write'):6.2f}")
PY
cat $R/marks.txt
python3 - <<'PY'
import os, csv
rows = list(csv.reader(open(os.environ["OUT"] + "/r/smi_log.csv")))[1:]
sm = [int(r[1].split()[0]) for r in rows if len(r) > 2 and r[1].strip()[0].isdigit()]
pw = [float(r[3].split()[0]) for r in rows if len(r) > 3 and r[3].strip()[0].isdigit()]
print("smi samples", len(sm), "sm MHz min/median/max", min(sm), sorted(sm)[len(sm)//2], max(sm), "power max", max(pw))
print("throttle reasons seen", sorted(set(r[5].strip() for r in rows if len(r) > 5)))
PY
tar czf $OUT/pipe4.tgz -C $R . && rm -rf $R
