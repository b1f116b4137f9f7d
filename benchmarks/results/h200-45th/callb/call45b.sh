# Issue 17, bf16 at 64 tokens: t (the tree: the unpaired 16-bit pair kernels are instantiated only where reachable)
# against p0 (16-bit rotary writes in unit pairs at every size) and ns (NeoX partner chunks loaded, not shuffled).
# Then the forty-fourth session's "not explained": clocks and throttle reasons logged beside the 64-token writes, the
# native variants alone for many rounds, then the op (bf16 tables, then f32 half tables) once each, then again.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=5
R=/tmp/r; mkdir -p $R; cp .scratch/call45b.sh .scratch/s45/order_probe2.py $R/; git diff HEAD -- csrc > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call45b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [t]="" [p0]="-DKVFUSE_ROPE_16BIT_PAIRS_FROM=0" [ns]="-DKVFUSE_ROPE_PARTNER_SHUFFLE=0" )
for v in t p0 ns; do
  (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py $v > $R/build_$v.log 2>&1) &
done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_*.log; then echo "a build failed"; save; exit 1; fi
run() { v=$1; shift; KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$PWD "$@"; }
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
bench() { d=$R/b$1_$2; mkdir -p $d; run $1 timeout 50 python3 -m benchmarks.rope_write --quick --out $d --tokens 64,256,1024 --formats $3 --variants "$VV" > $d/log.txt 2>&1 || echo "rope $1 rc=$?"; echo "rope $1 $2 ${SECONDS}s"; }
bench t 1 bfloat16,fp8,nvfp4; bench p0 1 bfloat16; bench ns 1 bfloat16,fp8,nvfp4; bench ns 2 bfloat16,fp8,nvfp4; bench p0 2 bfloat16; bench t 2 bfloat16,fp8,nvfp4; save
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_event_reasons.active --format=csv -lms 500 > $R/clocks.csv 2>&1 &
SMI=$!
run t timeout 150 python3 .scratch/s45/order_probe2.py 12 2>&1 | grep -v Warning | tee $R/order2.txt
kill $SMI; save
awk -F', ' 'NR>1 {print $2, $6}' $R/clocks.csv | sort | uniq -c | sort -rn | head -8
echo "done ${SECONDS}s"; save
