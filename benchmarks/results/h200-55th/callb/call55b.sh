# Issue 17, 55th session call b. Builds over HEAD's tree with KVFUSE_ROPE_NARROW_EXACT=2 (call a's
# e2): n (FP8 8-element units below 65536 16-element units, unit pairs from there: HEAD's
# thresholds), q512 / q256 / q128 (narrow units below and unit pairs from 512 / 256 / 128 tokens
# of 8 x 128). FP8 at 128-1023 tokens, 3 rounds. Then the table-placement probe at 64 tokens.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r55b; mkdir -p $R; cp .scratch/call55b.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call55b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
E="-DKVFUSE_ROPE_NARROW_EXACT=2"
th() { echo "$E -DKVFUSE_ROPE_FP8_NARROW_BELOW=$1 -DKVFUSE_ROPE_PAIRS_FROM=$1"; }
declare -A FLAGS=( [n]="$E" [q512]="$(th 32768)" [q256]="$(th 16384)" [q128]="$(th 8192)" )
run() { local v=$1; shift; (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$ROOT "$@"); }
for v in n q512 q256 q128; do run $v python3 $ROOT/.scratch/s55/build.py $v > $R/build_$v.log 2>&1 & done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
bench() { local g=$1 v=$2 r=$3 fm=$4 tk=$5; local d=$R/$g/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --quick --out $d --tokens $tk --formats $fm --variants "$VV" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "$g $v $r ${SECONDS}s"; }
for r in 1 2 3; do for v in n q512 q256 q128; do bench fp8 $v $r fp8 128,192,256,384,512,768,1023; done; done; save
python3 .scratch/s55/summarize.py $R/fp8 > $R/fp8_summary.txt; cat $R/fp8_summary.txt
run n timeout 150 python3 .scratch/s55/probe_tables.py $R/probe_tables.json > $R/probe_tables.txt 2>&1; echo "probe rc=$? ${SECONDS}s"; cut -c1-900 $R/probe_tables.txt
save; echo "done ${SECONDS}s"
