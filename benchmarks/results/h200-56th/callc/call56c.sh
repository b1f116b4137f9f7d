# Issue 17, 56th session call c. One build h (the tree: HEAD's kernels, interleaved timing). The
# placement probe (FP8, 32 and 64 tokens: each buffer moved alone); the interleaved rope_write
# matrix (all formats, 64 and 4096 tokens, 15 rounds); then test_native.py's GPU tests.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=16
R=/tmp/r56c; mkdir -p $R; cp .scratch/call56c.sh .scratch/s56/probe_place.py $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call56c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
run() { (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_h PYTHONPATH=/tmp/site:$ROOT "$@"); }
run python3 $ROOT/.scratch/s56/build.py h > $R/build_h.log 2>&1; tail -qn 1 $R/build_h.log; echo "build ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "the build failed"; save; exit 1; fi
run timeout 120 python3 $ROOT/.scratch/s56/probe_place.py $R/probe_place.json > $R/probe_place.txt 2>&1; echo "probe rc=$? ${SECONDS}s"; save
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
d=$R/main/bh_1; mkdir -p $d; run timeout 100 python3 -m benchmarks.rope_write --rounds 15 --out $d --tokens 64,4096 --formats bfloat16,fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1; echo "main ${SECONDS}s"
python3 .scratch/s56/summarize.py $R/main > $R/main_summary.txt; save
left=$((540 - SECONDS)); run timeout $left python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_native.py > $R/pytest_native.txt 2>&1; echo "pytest native rc=$? ${SECONDS}s"; tail -n 2 $R/pytest_native.txt
save
cat $R/main_summary.txt
python3 - $R/probe_place.json <<'PY'
import json, sys, statistics, collections
rows = json.load(open(sys.argv[1])); g = collections.defaultdict(list)
for r in rows: g[(r["tokens"], r["moved"])].append(r["ratio"])
for k, v in sorted(g.items()): print(k, "median %.3f min %.3f max %.3f" % (statistics.median(v), min(v), max(v)))
PY
echo "done ${SECONDS}s"
