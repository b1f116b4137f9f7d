# Issue 17, 56th session call d. One build h (the tree: HEAD's kernels). The stream probe: does the
# stream a graph's warm-up ran on decide the small rotary write's level? FP8, 32 and 64 tokens.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=16
R=/tmp/r56d; mkdir -p $R; cp .scratch/call56d.sh .scratch/s56/probe_stream.py $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call56d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
run() { (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_h PYTHONPATH=/tmp/site:$ROOT "$@"); }
run python3 $ROOT/.scratch/s56/build.py h > $R/build_h.log 2>&1; tail -qn 1 $R/build_h.log; echo "build ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "the build failed"; save; exit 1; fi
run timeout 200 python3 $ROOT/.scratch/s56/probe_stream.py $R/probe_stream.json > $R/probe_stream.txt 2>&1; echo "probe rc=$? ${SECONDS}s"; save
python3 - $R/probe_stream.json <<'PY'
import json, sys, collections
rows = json.load(open(sys.argv[1])); g = collections.defaultdict(list)
for r in rows: g[(r["tokens"], r["phase"])].append(r["ratio"])
for k, v in g.items(): print(k, " ".join("%.2f" % x for x in v))
PY
echo "done ${SECONDS}s"
