# Issue 17, 58th session call c. Builds: h (the tree's defaults = HEAD's kernels), od (unpaired
# launches build one divider; both scales loaded by volatile loads into their own registers, one
# selected). Interleaved rope_write (15 rounds): FP8 at 16 (burn-in) to 4096 tokens on h, od, od,
# h (one process each); bf16 and NVFP4 at 16,64,1024,4096 on h and od. Then the GPU tests of
# test_native.py and the rotary write's special-value / division / unit-pair / bit-exact tests on od.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r58c; mkdir -p $R; cp .scratch/call58c.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call58c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [h]="" [od]="-DKVFUSE_ONE_DIVIDER=1" )
run() { local v=$1; shift; (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$ROOT "$@"); }
for v in h od; do run $v python3 $ROOT/.scratch/s56/build.py $v > $R/build_$v.log 2>&1 & done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; fi
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
bench() { local g=$1 v=$2 r=$3 fm=$4 tk=$5; local d=$R/$g/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --rounds 15 --out $d --tokens $tk --formats $fm --variants "$VV" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "$g $v $r ${SECONDS}s"; }
bench fp8 h 1 fp8 16,64,256,1024,4096; bench fp8 od 1 fp8 16,64,256,1024,4096
bench fp8 od 2 fp8 16,64,256,1024,4096; bench fp8 h 2 fp8 16,64,256,1024,4096; save
bench all h 1 bfloat16,nvfp4 16,64,1024,4096; bench all od 1 bfloat16,nvfp4 16,64,1024,4096; save
python3 .scratch/s56/summarize.py $R/fp8 > $R/fp8_summary.txt; python3 .scratch/s56/summarize.py $R/all > $R/all_summary.txt
left=$((565 - SECONDS))
run od timeout $left python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_native.py tests/ops/test_rope_kv_write.py -k "test_native.py or special_values or unit_pairs or every_division or bit_exact" > $R/pytest_od.txt 2>&1; echo "tests od rc=$? ${SECONDS}s"
grep -E "passed|failed|error" $R/pytest_od.txt | tail -2; grep -E "^FAILED|^ERROR" $R/pytest_od.txt | head -10
save; cat $R/fp8_summary.txt; cat $R/all_summary.txt; echo "done ${SECONDS}s"
