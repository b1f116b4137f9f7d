# Issue 17, 55th session call c. Builds: h (HEAD f9d9ba6), t (the tree: FP8 8-element rotary units
# take the one-product division and one NaN branch; FP8 unit pairs from 8192 units, 128 tokens of
# 8 x 128), p64 (t with unit pairs from 4096 units, 64 tokens). The graph-size probe at 64 tokens on
# t; FP8 at 64-128 tokens, h / t / p64, 3 rounds.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r55c; mkdir -p $R; cp .scratch/call55c.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call55c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
mkdir -p /tmp/base && git archive HEAD | tar -x -C /tmp/base
declare -A DIR=( [h]=/tmp/base [t]=$ROOT [p64]=$ROOT )
declare -A FLAGS=( [h]="" [t]="" [p64]="-DKVFUSE_ROPE_PAIRS_FROM=4096" )
run() { local v=$1; shift; (cd ${DIR[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${DIR[$v]} "$@"); }
for v in h t p64; do run $v python3 $ROOT/.scratch/s55/build.py $v > $R/build_$v.log 2>&1 & done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run t timeout 150 python3 $ROOT/.scratch/s55/probe_graph.py $R/probe_graph.json > $R/probe_graph.txt 2>&1; echo "probe rc=$? ${SECONDS}s"; save
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
bench() { local g=$1 v=$2 r=$3 fm=$4 tk=$5; local d=$R/$g/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --quick --out $d --tokens $tk --formats $fm --variants "$VV" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "$g $v $r ${SECONDS}s"; }
for r in 1 2 3; do for v in h t p64; do bench fp8 $v $r fp8 64,96,128; done; done; save
python3 .scratch/s55/summarize.py $R/fp8 > $R/fp8_summary.txt; cat $R/fp8_summary.txt
cut -c1-400 $R/probe_graph.txt
save; echo "done ${SECONDS}s"
