# Issue 17: small FP8 / 16-bit rotary writes in 16-element units at 128 threads (w16) or 8-element units at 128 (n128)
# against the working tree's default (new: 8-element units below 65536 units, at 256 threads), 64..1024 tokens.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=5
R=/tmp/r; mkdir -p $R; cp .scratch/call39d.sh $R/; 
SECONDS=0
save() { tar czf $OUT/call39d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [new]="" [w16]="-DKVFUSE_ROPE_FP8_NARROW_BELOW=0" [n128]="-DKVFUSE_ROPE_NARROW_THREADS=128" )
declare -A TREE=( [new]=$PWD [w16]=$PWD [n128]=$PWD )
for v in new w16 n128; do
  (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
run() { v=$1; shift; (cd ${TREE[$v]} && KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:${TREE[$v]} "$@"); }
VV="write;rope_k+write (native), f32 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 80 python3 -m benchmarks.rope_write --quick --out $d --tokens 64,256,1024 --formats bfloat16,fp8 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench new 1; bench w16 1; bench n128 1; bench n128 2; bench new 2; bench w16 2; bench w16 3; bench n128 3; bench new 3; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
save; echo "done ${SECONDS}s"
