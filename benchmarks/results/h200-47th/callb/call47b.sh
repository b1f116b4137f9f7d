# Issue 17, bf16 at 64 tokens: ncu (full set, SASS stall samples) of the write alone and the native
# rotary write over float32 / bf16 half tables; then six A/B-style rounds of the tree at 64 tokens.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=12
R=/tmp/r47b; mkdir -p $R; cp .scratch/call47b.sh $R/; git diff HEAD > $R/tree.patch
SECONDS=0
save() { tar czf $OUT/call47b.tgz -C $R . ; }
which ncu nsys compute-sanitizer; ncu --version | tail -1
(KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_t PYTHONPATH=/tmp/site:$PWD python3 .scratch/s29/build.py t > $R/build_t.log 2>&1)
tail -n1 $R/build_t.log; echo "build ${SECONDS}s"
run() { KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_t PYTHONPATH=/tmp/site:$PWD "$@"; }
for w in write rot rotb; do
  run timeout 150 ncu --clock-control none --cache-control all --set full --import-source no --warp-sampling-interval 0 \
    -k regex:rows_kernel --launch-skip 16 --launch-count 2 -f -o $R/prof_$w python3 .scratch/s47/ncu_probe.py $w 4 > $R/ncu_$w.log 2>&1
  echo "ncu $w rc=$? ${SECONDS}s"; tail -3 $R/ncu_$w.log
  ncu -i $R/prof_$w.ncu-rep --page details --csv > $R/details_$w.csv 2> $R/details_$w.err
  ncu -i $R/prof_$w.ncu-rep --page source --csv --print-source sass > $R/source_$w.csv 2> $R/source_$w.err
  ls -la $R/details_$w.csv $R/source_$w.csv; head -c 300 $R/source_$w.err
done
save
VV="write;rope_k+write (native), f32 half tables;rope_k+write (native), bf16 half tables"
for r in 1 2 3 4 5 6; do d=$R/bt_$r; mkdir -p $d; run timeout 40 python3 -m benchmarks.rope_write --quick --out $d --tokens 64,256 --formats bfloat16 --variants "$VV" > $d/log.txt 2>&1 || echo "rope rc=$?"; echo "rope $r ${SECONDS}s"; done
python3 .scratch/s38/summarize26.py $R | tee $R/rope_summary.txt
save; echo "done ${SECONDS}s"
