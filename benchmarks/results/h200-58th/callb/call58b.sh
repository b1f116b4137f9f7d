# Issue 17, 58th session call b. Builds: h (the tree's defaults = HEAD's kernels), od (unpaired
# launches build one divider: both scales loaded, one selected), ol (od + the 32-bit page division
# laid out as the likely path), nt (od + FP8 NeoX below 256 tokens in 8-element single units in
# 128-thread blocks). Interleaved rope_write (15 rounds): FP8 at 16 (burn-in) to 4096 tokens,
# every build, two processes each; every format at 16,64,4096 on h and od, two processes. Then
# the GPU tests of test_native.py and the rotary write's special-value / division / unit-pair /
# bit-exact tests on od.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=6
R=/tmp/r58b; mkdir -p $R; cp .scratch/call58b.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call58b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
OD="-DKVFUSE_ONE_DIVIDER=1"
declare -A FLAGS=( [h]="" [od]="$OD" [ol]="$OD -DKVFUSE_LOCATE_EXPECT=1" [nt]="$OD -DKVFUSE_ROPE_PAIRS_FROM=16384 -DKVFUSE_ROPE_FP8_NARROW_THREADS=128" )
run() { local v=$1; shift; (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$ROOT "$@"); }
for v in h od ol nt; do run $v python3 $ROOT/.scratch/s56/build.py $v > $R/build_$v.log 2>&1 & done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; fi
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
bench() { local g=$1 v=$2 r=$3 fm=$4 tk=$5; local d=$R/$g/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --rounds 15 --out $d --tokens $tk --formats $fm --variants "$VV" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "$g $v $r ${SECONDS}s"; }
for v in h od ol nt; do bench fp8 $v 1 fp8 16,64,256,1024,4096; done
for v in nt ol od h; do bench fp8 $v 2 fp8 16,64,256,1024,4096; done; save
for v in h od od h; do bench all $v $SECONDS bfloat16,fp8,nvfp4 16,64,4096; done; save
python3 .scratch/s56/summarize.py $R/fp8 > $R/fp8_summary.txt; python3 .scratch/s56/summarize.py $R/all > $R/all_summary.txt
left=$((575 - SECONDS))
run od timeout $left python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_native.py tests/ops/test_rope_kv_write.py -k "test_native.py or special_values or unit_pairs or every_division or bit_exact" > $R/pytest_od.txt 2>&1; echo "tests od rc=$? ${SECONDS}s"
grep -E "passed|failed|error" $R/pytest_od.txt | tail -2; grep -E "^FAILED|^ERROR" $R/pytest_od.txt | head -10
save; cat $R/fp8_summary.txt; cat $R/all_summary.txt; echo "done ${SECONDS}s"
