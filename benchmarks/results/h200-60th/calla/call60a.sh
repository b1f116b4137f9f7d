# 60th session call a: the new GPU tests of the transformers integration, then the native kernels' GPU tests.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=16 PYTHONPATH=/tmp/site:$PWD
R=/tmp/r60a; mkdir -p $R; cp .scratch/call60a.sh $R/; git diff HEAD > $R/tree.patch; git status --short > $R/status.txt; git rev-parse HEAD > $R/head.txt
SECONDS=0
save() { tar czf $OUT/call60a.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" | tee $R/versions.txt
python3 -c "from kvfuse.ops import native; print(native.build_info(build=True))" > $R/build.log 2>&1; echo "build ${SECONDS}s"
run() { name=$1; lim=$2; shift 2; left=$((575 - SECONDS)); [ $left -lt $lim ] && lim=$left; [ $lim -lt 20 ] && { echo "$name skipped"; return; }
  timeout $lim python3 -m pytest -v --tb=short -rfE -m gpu -p no:cacheprovider "$@" > $R/$name.txt 2>&1
  echo "$name rc=$? ${SECONDS}s"; grep -E "(passed|failed|error)" $R/$name.txt | tail -1; grep -E "^(FAILED|ERROR) " $R/$name.txt | head -12; save; }
run integ 260 -n 8 tests/integrations/test_transformers_gpu.py
run native 300 -n 16 tests/ops/test_native.py tests/ops/test_native_attention.py tests/ops/test_native_prefill.py tests/ops/test_per_token_head.py
save; echo "done ${SECONDS}s"
