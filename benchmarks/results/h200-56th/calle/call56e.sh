# Issue 17, 56th session call e. Builds: h (the tree, HEAD's kernels) and rnp (rotary writes
# launched without programmatic dependent launch; the writes alone keep it). Interleaved
# rope_write (15 rounds), all formats at 16, 32, 64, 256 and 4096 tokens; then the stream probe
# on rnp.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r56e; mkdir -p $R; cp .scratch/call56e.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call56e.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [h]="" [rnp]="-DKVFUSE_ROPE_PDL=0" )
run() { local v=$1; shift; (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$ROOT "$@"); }
for v in h rnp; do run $v python3 $ROOT/.scratch/s56/build.py $v > $R/build_$v.log 2>&1 & done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
bench() { local g=$1 v=$2 r=$3 fm=$4 tk=$5; local d=$R/$g/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --rounds 15 --out $d --tokens $tk --formats $fm --variants "$VV" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "$g $v $r ${SECONDS}s"; }
for v in rnp h; do bench all $v 1 fp8,bfloat16,nvfp4 16,32,64,256,4096; done; save
python3 .scratch/s56/summarize.py $R/all > $R/all_summary.txt
run rnp timeout 60 python3 $ROOT/.scratch/s56/probe_stream.py $R/probe_stream_rnp.json > $R/probe_stream_rnp.txt 2>&1; echo "probe rc=$? ${SECONDS}s"; save
cat $R/all_summary.txt
python3 - $R/probe_stream_rnp.json <<'PY'
import json, sys, collections
rows = json.load(open(sys.argv[1])); g = collections.defaultdict(list)
for r in rows: g[(r["tokens"], r["phase"])].append(r["ratio"])
for k, v in g.items(): print(k, " ".join("%.2f" % x for x in v))
PY
echo "done ${SECONDS}s"
