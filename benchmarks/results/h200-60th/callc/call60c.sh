# 60th session call c: the reworked transformers GPU tests, the errors behind their bounds, then op GPU tests call b did not reach.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=16 PYTHONPATH=/tmp/site:$PWD
R=/tmp/r60c; mkdir -p $R; cp .scratch/call60c.sh $R/; git diff HEAD > $R/tree.patch; git status --short > $R/status.txt; git rev-parse HEAD > $R/head.txt
SECONDS=0
save() { tar czf $OUT/call60c.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" | tee $R/versions.txt
python3 -c "from kvfuse.ops import native; print(native.build_info(build=True))" > $R/build.log 2>&1; echo "build ${SECONDS}s"
run() { name=$1; lim=$2; shift 2; left=$((520 - SECONDS)); [ $left -lt $lim ] && lim=$left; [ $lim -lt 20 ] && { echo "$name skipped"; return; }
  timeout $lim python3 -m pytest -v --tb=short -rfE -m gpu -p no:cacheprovider "$@" > $R/$name.txt 2>&1
  echo "$name rc=$? ${SECONDS}s"; grep -E "(passed|failed|error)" $R/$name.txt | tail -1; grep -E "^(FAILED|ERROR) " $R/$name.txt | head -12; save; }
run integ 200 -n 8 tests/integrations/test_transformers_gpu.py
timeout 100 python3 .scratch/s60/errors.py $R/errors.json > $R/errors.txt 2>&1; echo "errors rc=$? ${SECONDS}s"; grep -E " [0-9]\.[0-9]+e" $R/errors.txt; save
run ops 300 -n 16 tests/ops/test_triton_cache_write.py tests/ops/test_attention_features.py tests/ops/test_mixed_attention.py tests/ops/test_flashinfer.py tests/compile tests/test_benchmarks_common.py tests/ops/test_triton_attention.py
save; echo "done ${SECONDS}s"
