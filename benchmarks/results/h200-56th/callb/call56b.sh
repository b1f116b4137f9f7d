# Issue 17, 56th session call b: FP8 rotary writes at decode sizes in other unit shapes. Builds: h
# (the tree, experiments off: HEAD's kernels), w16 (16-element single units, partner by shuffle,
# at every size, with the one-product division and one NaN branch per unit), pw16 (unit pairs of
# 16-element units instead of 8, at a budget of 128 registers, for
# decode sizes). Interleaved rope_write (--rounds 15), FP8 at 32, 64, 128
# and 4096 tokens, two processes per build (each checks its kernels bit-exact first).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r56b; mkdir -p $R; cp .scratch/call56b.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call56b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [h]="" [w16]="-DKVFUSE_ROPE_FP8_NARROW_BELOW=0 -DKVFUSE_ROPE_PAIRS_FROM=1099511627776 -DKVFUSE_ROPE_WIDE_SINGLE_EXACT=1" [pw16]="-DKVFUSE_ROPE_FP8_PAIR_UNIT=16 -DKVFUSE_ROPE_PAIR_MIN_BLOCKS=2" )
run() { local v=$1; shift; (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$ROOT "$@"); }
for v in h w16 pw16; do run $v python3 $ROOT/.scratch/s56/build.py $v > $R/build_$v.log 2>&1 & done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
bench() { local g=$1 v=$2 r=$3 fm=$4 tk=$5; local d=$R/$g/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --rounds 15 --out $d --tokens $tk --formats $fm --variants "$VV" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "$g $v $r ${SECONDS}s"; }
for r in 1 2; do for v in h w16 pw16; do bench fp8 $v $r fp8 32,64,128,4096; done; done; save
python3 .scratch/s56/summarize.py $R/fp8 > $R/fp8_summary.txt
grep -l "differ" $R/fp8/*/log.txt && grep -h "differ" $R/fp8/*/log.txt | sort | uniq -c | head
save
cat $R/fp8_summary.txt
echo "done ${SECONDS}s"
