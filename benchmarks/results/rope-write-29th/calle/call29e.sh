set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8 BENCH_COMMIT=$(cat .scratch/commit)
REPO=$PWD
R=$OUT/r; mkdir -p $R /tmp/base; cp .scratch/call29e.sh $R/; tar xf .scratch/base_tree.tar -C /tmp/base
SECONDS=0
nvidia-smi --query-gpu=name,uuid --format=csv > $R/gpu.csv; cat $R/gpu.csv
# base: 12d5c8e (one page division per unit of a pair) | final: the working tree (one per pair)
declare -A TREE=( [base]=/tmp/base [final]=$REPO )
for v in base final; do
  (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v PYTHONPATH=/tmp/site:${TREE[$v]}:$REPO python3 $REPO/.scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 2 $R/build_*.log; echo "builds ${SECONDS}s"
VV="write;rope_k+write (native);rope_k+write (native), f32 half tables"
for rep in 1 2; do for v in base final; do
  d=$R/b${v}_$rep; mkdir -p $d
  (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v PYTHONPATH=/tmp/site:${TREE[$v]}:$REPO timeout 80 python3 -m benchmarks.rope_write --quick --out $d \
    --tokens 1024,4096,16384 --formats fp8,nvfp4 --variants "$VV" > $d/log.txt 2>&1) || echo "bench $d rc=$?"
done; echo "round $rep done at ${SECONDS}s"; done
grep -h "differ" $R/*/log.txt | sort | uniq -c | head -8
python3 .scratch/summarize26.py $R
export PYTHONPATH=/tmp/site:$REPO KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_final
KVFUSE_FAILURE_LOG=$R/failures.txt timeout 150 python3 -m pytest -q -m gpu -n 12 -k "unit_pairs or bit_exact" tests/ops/test_rope_kv_write.py \
  -p no:cacheprovider > $R/gpu_rope.log 2>&1
echo "tests rc=$? at ${SECONDS}s: $(tail -c 300 $R/gpu_rope.log | tail -2)"; head -c 2500 $R/failures.txt 2>/dev/null
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 tests/ops/_native_sanitize.py rope > $R/sanitizer_rope.log 2>&1
echo "memcheck rc=$? ($(tail -2 $R/sanitizer_rope.log | tr '\n' ' ')) at ${SECONDS}s"
tar czf $OUT/call29e.tgz -C $R . && rm -rf $R
