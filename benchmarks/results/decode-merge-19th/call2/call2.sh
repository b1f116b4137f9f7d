set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R; cp .scratch/call2.sh $R/
SECONDS=0
ROOT=$PWD; OLD=$ROOT/.scratch/old_repo
NR="-DKVFUSE_DECODE_CLUSTER_MERGE=0"
build() { (cd $1 && PYTHONPATH=/tmp/site:$1 KVFUSE_NATIVE_BUILD_DIR=$3 KVFUSE_NATIVE_CUDA_FLAGS="$2" python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build:', i.get('built'), i.get('build_seconds'), i.get('error'))" 2>&1 | grep '^build' | sed "s/^/[$4] /"); }
build $OLD "" /tmp/b_old O & build $ROOT "" /tmp/b_new N & build $ROOT "$NR" /tmp/b_new R & wait
echo "builds at ${SECONDS}s"
export PYTHONPATH=/tmp/site:$ROOT
KVFUSE_NATIVE_BUILD_DIR=/tmp/b_new timeout 200 python3 -m pytest -q -m gpu tests/ops/test_native_attention.py -n 8 -p no:cacheprovider > $R/t_attn_N.log 2>&1; echo "N test_native_attention: $(tail -1 $R/t_attn_N.log)"
grep -E "^(FAILED|ERROR)" $R/t_attn_N.log | head -5
echo "tests at ${SECONDS}s"
sum() { grep -o '"mode".*"us": [0-9.]*' $1 | sed 's/"mode": //;s/"batch": //;s/"context": //;s/"splits": //;s/"us": //;s/"//g' | tr '\n' ' '; }
for r in 1 2; do
  (cd $OLD && PYTHONPATH=/tmp/site:$OLD KVFUSE_NATIVE_BUILD_DIR=/tmp/b_old timeout 60 python3 $ROOT/.scratch/ab_cold.py $R/O_$r.json 1 4 fp8,nvfp4 > $R/O_$r.log 2>&1); echo "O $r: $(sum $R/O_$r.log)"
  KVFUSE_NATIVE_BUILD_DIR=/tmp/b_new timeout 60 python3 .scratch/ab_cold.py $R/N_$r.json 1 4,8 fp8,nvfp4 > $R/N_$r.log 2>&1; echo "N $r: $(sum $R/N_$r.log)"
  KVFUSE_NATIVE_BUILD_DIR=/tmp/b_new KVFUSE_NATIVE_CUDA_FLAGS="$NR" timeout 60 python3 .scratch/ab_cold.py $R/R_$r.json 1 4 fp8,nvfp4 > $R/R_$r.log 2>&1; echo "R $r: $(sum $R/R_$r.log)"
done
echo "done at ${SECONDS}s"
tar czf $OUT/call2.tgz -C $R . && rm -rf $R
