# The 64-token slow state: a graph captured once and replayed every round, beside fresh captures (graph_probe.py).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=16
R=/tmp/r; mkdir -p $R; cp .scratch/call45g.sh .scratch/s45/graph_probe.py $R/
SECONDS=0
save() { tar czf $OUT/call45g.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
run() { KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_t PYTHONPATH=/tmp/site:$PWD "$@"; }
run python3 .scratch/s29/build.py t > $R/build_t.log 2>&1; tail -n1 $R/build_t.log; echo "build ${SECONDS}s"; save
run timeout 60 python3 .scratch/s45/graph_probe.py 30 2>&1 | grep -v Warning | tee $R/graph_probe.txt; save
echo "done ${SECONDS}s"
