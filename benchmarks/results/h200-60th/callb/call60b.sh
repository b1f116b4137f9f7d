# 60th session call b: the remaining op GPU tests (all but the rotary write, run in the 59th), the compile and model GPU tests, and the errors behind the new integration tests' bounds.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=16 PYTHONPATH=/tmp/site:$PWD
R=/tmp/r60b; mkdir -p $R; cp .scratch/call60b.sh $R/; git diff HEAD > $R/tree.patch; git status --short > $R/status.txt; git rev-parse HEAD > $R/head.txt
SECONDS=0
save() { tar czf $OUT/call60b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" | tee $R/versions.txt
python3 -c "from kvfuse.ops import native; print(native.build_info(build=True))" > $R/build.log 2>&1; echo "build ${SECONDS}s"
run() { name=$1; lim=$2; shift 2; left=$((575 - SECONDS)); [ $left -lt $lim ] && lim=$left; [ $lim -lt 20 ] && { echo "$name skipped"; return; }
  timeout $lim python3 -m pytest -v --tb=short -rfE -m gpu -p no:cacheprovider "$@" > $R/$name.txt 2>&1
  echo "$name rc=$? ${SECONDS}s"; grep -E "(passed|failed|error)" $R/$name.txt | tail -1; grep -E "^(FAILED|ERROR) " $R/$name.txt | head -12; save; }
timeout 150 python3 .scratch/s60/errors.py $R/errors.json > $R/errors.txt 2>&1; echo "errors rc=$? ${SECONDS}s"; cat $R/errors.txt | grep -v Warning | tail -16; save
run ops 330 -n 16 tests/ops tests/test_benchmarks_common.py tests/compile tests/distributed --ignore tests/ops/test_native.py --ignore tests/ops/test_native_attention.py --ignore tests/ops/test_native_prefill.py --ignore tests/ops/test_per_token_head.py --ignore tests/ops/test_rope_kv_write.py
run memory 60 tests/models/test_memory.py
save; echo "done ${SECONDS}s"
