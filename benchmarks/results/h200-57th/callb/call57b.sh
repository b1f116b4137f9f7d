# Issue 17, 57th session call b. Builds: h (HEAD's kernels), m (-DKVFUSE_FP8_PAIR_NAN_CHECK=1: one
# NaN branch per FP8 unit pair), s (-DKVFUSE_ROPE_WIDENED_SELECT=1: rotated/unrotated by select),
# ms (both). Interleaved rope_write (15 rounds), FP8 at 16 (burn-in), 64, 256, 1024 and 4096
# tokens, two processes per build in alternating order; then the GPU tests of the touched paths on ms.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=6
R=/tmp/r57b; mkdir -p $R; cp .scratch/call57b.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call57b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [h]="" [m]="-DKVFUSE_FP8_PAIR_NAN_CHECK=1" [s]="-DKVFUSE_ROPE_WIDENED_SELECT=1" [ms]="-DKVFUSE_FP8_PAIR_NAN_CHECK=1 -DKVFUSE_ROPE_WIDENED_SELECT=1" )
run() { local v=$1; shift; (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$ROOT "$@"); }
for v in h m s ms; do run $v python3 $ROOT/.scratch/s56/build.py $v > $R/build_$v.log 2>&1 & done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
bench() { local g=$1 v=$2 r=$3 fm=$4 tk=$5; local d=$R/$g/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --rounds 15 --out $d --tokens $tk --formats $fm --variants "$VV" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "$g $v $r ${SECONDS}s"; }
for v in h m s ms; do bench fp8 $v 1 fp8 16,64,256,1024,4096; done; save
for v in ms s m h; do bench fp8 $v 2 fp8 16,64,256,1024,4096; done; save
python3 .scratch/s56/summarize.py $R/fp8 > $R/fp8_summary.txt
left=$((560 - SECONDS))
run ms timeout $left python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "special_values or unit_pairs or every_division or bit_exact" > $R/pytest_ms.txt 2>&1; echo "tests rc=$? ${SECONDS}s"
grep -E "passed|failed|error" $R/pytest_ms.txt | tail -3; grep -E "^FAILED|^ERROR" $R/pytest_ms.txt | head -20
save; cat $R/fp8_summary.txt; echo "done ${SECONDS}s"
