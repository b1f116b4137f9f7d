# Issue 17 / NVFP4 write, 52nd session call d: the NVFP4 write alone at 6 resident blocks per SM
# (n6: -DKVFUSE_NVFP4_MIN_BLOCKS=6, 40 registers; ptxas spills 8 bytes in the paired 16-bit kernels)
# against HEAD's 5 (t). cache_write --quick, three rounds each, alternating.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=8
R=/tmp/r52d; mkdir -p $R; cp .scratch/call52d.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call52d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [n6]="-DKVFUSE_NVFP4_MIN_BLOCKS=6" )
for v in t n6; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s52/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
i=0; for v in t n6 n6 t t n6; do i=$((i+1)); d=$R/cw_${v}_$i; mkdir -p $d
  KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD timeout 100 python3 -m benchmarks.cache_write --quick --formats nvfp4 --impls kvfuse_native --out $d > $d/log.txt 2>&1 || echo "cw $v rc=$?"
  echo "cw $v ${SECONDS}s $(grep -E 'nvfp4 +(1024|16384|65536) ' $d/log.txt | awk '{print $2": "$4" us "$NF}' | tr '\n' ' ')"; done
save; echo "done ${SECONDS}s"
