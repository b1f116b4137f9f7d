# Issue 17 on the H200 at the session's kernel commit: the whole rotary write benchmark (--quick: decode 64
# and prefill 4096, every format and variant, FlashInfer's rope_quantize_fp8_append_paged_kv_cache), then the
# FP8 rotary GPU tests while time is left.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 MAX_JOBS=16 BENCH_COMMIT=$(cat .scratch/commit)
R=/tmp/r; mkdir -p $R; cp .scratch/call38d.sh $R/
SECONDS=0
save() { tar czf $OUT/call38d.tgz -C $R . ; }
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > $R/gpu.csv; cat $R/gpu.csv
export PYTHONPATH=/tmp/site:$PWD KVFUSE_NATIVE_BUILD_DIR=/tmp/nb_new
python3 .scratch/s29/build.py new > $R/build_new.log 2>&1; tail -n 1 $R/build_new.log; echo "build ${SECONDS}s"
mkdir -p $R/rope; timeout 300 python3 -m benchmarks.rope_write --quick --out $R/rope > $R/rope/log.txt 2>&1; echo "rope rc=$? ${SECONDS}s"
grep -h differ $R/rope/log.txt | head -3; save
[ $SECONDS -lt 400 ] && { timeout $((500 - SECONDS)) python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu -n 16 -rfE \
  tests/ops/test_rope_kv_write.py -k "e4m3 or e5m2" > $R/tests.log 2>&1; echo "pytest rc=$? ${SECONDS}s"; tail -n 2 $R/tests.log; }
save
python3 - $R/rope/rope_write.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["tokens"], r["format"], "write", r["write"], "native f32h", r.get("rope_k+write (native), f32 half tables"),
          "native bf16", r.get("rope_k+write (native)"), "| ratios", r.get("native f32 half tables / write"),
          r.get("native rope_k+write / write"), r.get("native bf16 half tables / write"), "fi", r.get("flashinfer"))
PY
echo "done ${SECONDS}s"
