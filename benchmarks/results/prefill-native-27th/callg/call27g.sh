set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 KVFUSE_NATIVE=0 BENCH_COMMIT=$(cat .scratch/commit)
R=$OUT/r; mkdir -p $R /tmp/old; cp .scratch/call27g.sh $R/; tar xf .scratch/old_tree.tar -C /tmp/old
SECONDS=0
for round in 1 2; do
for t in old new; do
  T=$PWD; [ $t = old ] && T=/tmp/old
  (cd $T && PYTHONPATH=/tmp/site:$T timeout 120 python3 -m benchmarks.attention --only prefill --prefills 4096,16384 --modes fp8 --impls kvfuse --rounds 1 --out $R/${t}_$round > $R/${t}_$round.log 2>&1); echo "$t $round rc=$? ${SECONDS}s"
  grep -h '"impl": "kvfuse"' $R/${t}_$round.log | python3 -c "import sys,json
for l in sys.stdin:
    r=json.loads(l); print('$t', r['context'], r['us'], r['tflops'])"
done
done
tar czf $OUT/call27g.tgz -C $R . && rm -rf $R
