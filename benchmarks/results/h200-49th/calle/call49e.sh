# Issue 17, 49th session call e: ncu (full set, SASS stall samples) of the FP8 4096-token paired
# rotary write over full-width bf16 tables and over float32 half tables (the tree, 3310935's kernels):
# why the upper columns' two loads cost ~2% where the float32 half tables' as many loads do not.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/depyf*.whl .whl/dill*.whl .whl/astor*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=16
R=/tmp/r49e; mkdir -p $R; cp .scratch/call49e.sh .scratch/s49/ncu_probe.py $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0
save() { tar czf $OUT/call49e.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid --format=csv,noheader > $R/gpu.csv
(KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_t PYTHONPATH=/tmp/site:$PWD python3 .scratch/s49/build.py t > $R/build_t.log 2>&1)
tail -n1 $R/build_t.log; echo "build ${SECONDS}s"
run() { KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_t PYTHONPATH=/tmp/site:$PWD "$@"; }
for w in full half32; do
  run timeout 60 ncu --clock-control none --cache-control all --set full --import-source no --warp-sampling-interval 0 \
    -k regex:rows_kernel --launch-skip 8 --launch-count 1 -f -o $R/prof_$w python3 .scratch/s49/ncu_probe.py $w 2 > $R/ncu_$w.log 2>&1
  echo "ncu $w rc=$? ${SECONDS}s"; tail -n 2 $R/ncu_$w.log
  ncu -i $R/prof_$w.ncu-rep --page details --csv > $R/details_$w.csv 2> $R/details_$w.err
  ncu -i $R/prof_$w.ncu-rep --page source --csv --print-source sass > $R/source_$w.csv 2> $R/source_$w.err
  save
done
echo "done ${SECONDS}s"
