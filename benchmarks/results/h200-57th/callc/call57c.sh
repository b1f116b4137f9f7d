# Issue 17, 57th session call c. Builds: f (the tree: one NaN branch per FP8 unit pair, default),
# ks (-DKVFUSE_ROPE_KEY_SELECT=1), d1 / d3 (-DKVFUSE_ROPE_DIAG=1 / 3: diagnosis, not bit-exact).
# Interleaved rope_write (15 rounds): FP8 at 16 (burn-in) to 4096 tokens, f and ks, two processes
# each; every format at 64 and 4096 on f. diag.py on f, d1, d3 at 64 and 256 tokens. Then the GPU
# tests of the touched paths on the build pick.py prefers, and the short set on the other.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=6
R=/tmp/r57c; mkdir -p $R; cp .scratch/call57c.sh .scratch/s57/diag.py .scratch/s57/pick.py $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0; ROOT=$PWD
save() { tar czf $OUT/call57c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
declare -A FLAGS=( [f]="" [ks]="-DKVFUSE_ROPE_KEY_SELECT=1" [d1]="-DKVFUSE_ROPE_DIAG=1" [d3]="-DKVFUSE_ROPE_DIAG=3" )
run() { local v=$1; shift; (KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_$v KVFUSE_NATIVE_CUDA_FLAGS="${FLAGS[$v]}" PYTHONPATH=/tmp/site:$ROOT "$@"); }
for v in f ks d1 d3; do run $v python3 $ROOT/.scratch/s56/build.py $v > $R/build_$v.log 2>&1 & done
wait; tail -qn 1 $R/build_*.log; echo "builds ${SECONDS}s"; save
if grep -l "unavailable" $R/build_f.log $R/build_ks.log; then echo "a build failed"; save; exit 1; fi
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
bench() { local g=$1 v=$2 r=$3 fm=$4 tk=$5; local d=$R/$g/b${v}_$r; mkdir -p $d
  run $v timeout 100 python3 -m benchmarks.rope_write --rounds 15 --out $d --tokens $tk --formats $fm --variants "$VV" > $d/log.txt 2>&1 || echo "rope $v rc=$?"
  echo "$g $v $r ${SECONDS}s"; }
for v in f ks; do bench fp8 $v 1 fp8 16,64,256,1024,4096; done
for v in ks f; do bench fp8 $v 2 fp8 16,64,256,1024,4096; done; save
bench all f 1 bfloat16,fp8,nvfp4 16,64,4096; save
for v in f d1 d3; do run $v timeout 60 python3 $ROOT/.scratch/s57/diag.py $R/diag_$v.json 16 64 256 > $R/diag_$v.txt 2>&1; echo "diag $v rc=$? ${SECONDS}s"; done; save
python3 .scratch/s56/summarize.py $R/fp8 > $R/fp8_summary.txt; python3 .scratch/s56/summarize.py $R/all > $R/all_summary.txt
PICK=$(python3 $ROOT/.scratch/s57/pick.py $R/fp8 2>$R/pick.txt); cat $R/pick.txt; OTHER=$([ "$PICK" = ks ] && echo f || echo ks)
left=$((560 - SECONDS - 60))
run $PICK timeout $left python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "special_values or unit_pairs or every_division or bit_exact" > $R/pytest_$PICK.txt 2>&1; echo "tests $PICK rc=$? ${SECONDS}s"
grep -E "passed|failed|error" $R/pytest_$PICK.txt | tail -2; grep -E "^FAILED|^ERROR" $R/pytest_$PICK.txt | head -10; save
left=$((575 - SECONDS))
[ $left -gt 20 ] && { run $OTHER timeout $left python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/ops/test_rope_kv_write.py -k "special_values" > $R/pytest_$OTHER.txt 2>&1; echo "tests $OTHER rc=$? ${SECONDS}s"; grep -E "passed|failed|error" $R/pytest_$OTHER.txt | tail -2; }
save; cat $R/fp8_summary.txt; cat $R/all_summary.txt; cat $R/diag_*.txt; echo "done ${SECONDS}s"
