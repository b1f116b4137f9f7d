# Issue 17, 59th session call b: the GPU tests of the compile pass's rotary fusion and of the rotary
# write (call a's run was cut 5 tests short), then the cells in the fifty-eighth session's
# form (four variants, 15 rounds, one process per round) for all three formats.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=16 PYTHONPATH=/tmp/site:$PWD
R=/tmp/r59b; mkdir -p $R; cp .scratch/call59b.sh $R/; git diff HEAD > $R/tree.patch; git rev-parse HEAD > $R/head.txt
SECONDS=0
save() { tar czf $OUT/call59b.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
python3 -c "from kvfuse.ops import native; print(native.build_info(build=True))" > $R/build.log 2>&1; echo "build ${SECONDS}s"
VV="write;rope_k+write (native);rope_k+write (native), bf16 half tables;rope_k+write (native), f32 half tables"
for r in 1 2; do d=$R/cells/bh_$r; mkdir -p $d
  timeout 100 python3 -m benchmarks.rope_write --rounds 15 --out $d --tokens 16,64,4096 --formats fp8,nvfp4,bfloat16 --variants "$VV" > $d/log.txt 2>&1; echo "cells $r rc=$? ${SECONDS}s"; done
python3 .scratch/s56/summarize.py $R/cells > $R/cells_summary.txt; save
left=$((580 - SECONDS))
timeout $left python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider tests/compile/test_rope_fusion.py tests/ops/test_rope_kv_write.py > $R/pytest.txt 2>&1
echo "tests rc=$? ${SECONDS}s"; grep -E "passed|failed|error" $R/pytest.txt | tail -2; grep -E "^FAILED|^ERROR" $R/pytest.txt | head -10
save; cat $R/cells_summary.txt; echo "done ${SECONDS}s"
