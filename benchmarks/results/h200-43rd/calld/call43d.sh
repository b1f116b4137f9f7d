# The op's captured backend choice for small writes (kvfuse.ops.tuning: Triton below 1024 NVFP4 tokens, and for casts):
# Triton's fused write (kvfuse) against the native kernel (kvfuse_native) in one run, at the tree.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=16
R=/tmp/r; mkdir -p $R; cp .scratch/call43d.sh $R/; git diff HEAD -- csrc > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call43d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_t PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py t > $R/build_t.log 2>&1; tail -n1 $R/build_t.log; echo "build ${SECONDS}s"
mkdir -p $R/cw; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_t PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m benchmarks.cache_write --impls kvfuse,kvfuse_native --formats nvfp4,bfloat16,fp8_e4m3 --out $R/cw > $R/cw/log.txt 2>&1; echo "cache_write rc=$? ${SECONDS}s"
grep '^|' $R/cw/cache_write.md | cut -c1-160
save; echo "done ${SECONDS}s"
