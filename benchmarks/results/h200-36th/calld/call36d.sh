# Issue 17 on the H200: kernel durations (torch.profiler) of the write alone and the native rotary write
# (f32 half tables) beside their per-call graph times, NVFP4 / FP8, 4096 / 16384 tokens.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=16
R=/tmp/r; mkdir -p $R; cp .scratch/call36d.sh .scratch/s36/profile_rope.py $R/
SECONDS=0
save() { tar czf $OUT/call36d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
export PYTHONPATH=/tmp/site:$PWD
python3 .scratch/s29/build.py head > $R/build.log 2>&1; tail -n 1 $R/build.log; echo "build ${SECONDS}s"
for round in 1 2; do
  timeout 200 python3 .scratch/s36/profile_rope.py $R/profile_rope_$round.json > $R/profile_rope_$round.log 2>&1; echo "profile $round rc=$? ${SECONDS}s"
done
save
python3 - $R <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/profile_rope_*.json")):
    for r in json.load(open(f)):
        ks = "; ".join(f"{k[:40]} x{n} {us}" for k, (n, us) in r["kernels"].items())
        print(f[-6], r["fmt"], r["tokens"], r["variant"], r["graph_us_per_call"], "|", ks)
PY
echo "done ${SECONDS}s"
