set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=16
R=/tmp/r; mkdir -p $R; cp .scratch/call31d.sh .scratch/ab16k.py $R/
save() { tar czf $OUT/call31d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv > $R/gpu.csv; cat $R/gpu.csv
SECONDS=0
python3 .scratch/s29/build.py final > $R/build.log 2>&1; tail -1 $R/build.log; echo "build ${SECONDS}s"
for round in 1 2 3 4; do
  for m in $([ $((round % 2)) = 1 ] && echo "bf16 fp8" || echo "fp8 bf16"); do
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 20 > $R/smi_${m}_$round.csv &
    SMI=$!
    timeout 60 python3 .scratch/ab16k.py $m $m >> $R/ab.jsonl 2>>$R/ab_err.log &
    AB=$!
    [ $round = 1 ] && { sleep 8; nvidia-smi -q -d PERFORMANCE > $R/perf_${m}.txt; }
    wait $AB || echo "ab $m rc=$?"
    kill $SMI; wait $SMI 2>/dev/null
  done
  echo "round $round ${SECONDS}s"; save
  [ $SECONDS -gt 400 ] && break
done
python3 - $R <<'PY'
import json,sys,glob,statistics,collections
R=sys.argv[1]
us=collections.defaultdict(list)
for l in open(f"{R}/ab.jsonl"):
    r=json.loads(l); us[r["mode"]].append(r["us"])
for m in ("bf16","fp8"):
    clk=[];pw=[];rs=collections.Counter()
    for f in sorted(glob.glob(f"{R}/smi_{m}_*.csv")):
        for line in open(f):
            p=[x.strip() for x in line.split(",")]
            try: c=float(p[1]); w=float(p[2])
            except Exception: continue
            if w>250: clk.append(c); pw.append(w)
    print(m, "us", us[m], "| busy samples", len(clk), "SM MHz median", statistics.median(clk) if clk else None,
          "min", min(clk) if clk else None, "| W median", statistics.median(pw) if pw else None)
PY
save; echo "done ${SECONDS}s"
