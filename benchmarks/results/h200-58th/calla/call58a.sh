# Issue 17, 58th session call a. Builds: h (the tree's defaults = HEAD's kernels), pl / cg (table
# columns by ld.global.ca / ld.global.cg instead of __ldg), od (unpaired launches build one
# divider), up (unit pairs' upper column before the wait). Interleaved rope_write (15 rounds): FP8
# at 16 (burn-in) to 4096 tokens, every build, two processes each; every format at 16,64,4096 on
# h, pl, od. Then special_values + every_division on od and special_values on pl.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=5
R=/tmp/r58a; mkdir -p $R; cp .scratch/call58a.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call58a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [h]="" [pl]="-DKVFUSE_ROPE_TABLE_LOAD=1" [cg]="-DKVFUSE_ROPE_TABLE_LOAD=2" [od]="-DKVFUSE_ONE_DIVIDER=1" [up]="-DKVFUSE_ROPE_UPPER_BEFORE_WAIT=1" )
run() { local v=$1; shift; (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$ROOT "$@"); }
for v in h pl cg od up; do run $v python3 $ROOT/.scratch/s56/build.py $v > $R/build_$v.log 2>&1 & done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; fi
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
bench() { local g=$1 v=$2 r=$3 fm=$4 tk=$5; local d=$R/$g/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --rounds 15 --out $d --tokens $tk --formats $fm --variants "$VV" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "$g $v $r ${SECONDS}s"; }
for v in h pl cg od up; do bench fp8 $v 1 fp8 16,64,256,1024,4096; done
for v in up od cg pl h; do bench fp8 $v 2 fp8 16,64,256,1024,4096; done; save
for v in h pl od; do bench all $v 1 bfloat16,fp8,nvfp4 16,64,4096; done; save
python3 .scratch/s56/summarize.py $R/fp8 > $R/fp8_summary.txt; python3 .scratch/s56/summarize.py $R/all > $R/all_summary.txt
left=$((560 - SECONDS - 40))
run od timeout $left python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py tests/ops/test_native.py -k "special_values or every_division or division" > $R/pytest_od.txt 2>&1; echo "tests od rc=$? ${SECONDS}s"
grep -E "passed|failed|error" $R/pytest_od.txt | tail -2; grep -E "^FAILED|^ERROR" $R/pytest_od.txt | head -10; save
left=$((580 - SECONDS))
[ $left -gt 20 ] && { run pl timeout $left python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "special_values" > $R/pytest_pl.txt 2>&1; echo "tests pl rc=$? ${SECONDS}s"; grep -E "passed|failed|error" $R/pytest_pl.txt | tail -2; }
save; cat $R/fp8_summary.txt; cat $R/all_summary.txt; echo "done ${SECONDS}s"
