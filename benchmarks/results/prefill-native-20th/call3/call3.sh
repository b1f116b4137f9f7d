python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=$1 MAX_JOBS=16
R=$OUT/r; mkdir -p $R
python3 -c "from kvfuse.ops import native; print(native.build_info(build=True)['build_seconds'])" 2>&1 | tail -3
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_native_prefill.py 2>&1 | tail -30 > $R/tests.log
tail -3 $R/tests.log
for m in fp8 bf16; do
timeout 150 /usr/local/cuda/bin/ncu --set full -k regex:prefill_attention_kernel -s 2 -c 1 python3 .scratch/prof_native.py 4096 $m > $R/ncu_$m.txt 2>&1
echo "== $m"; grep -E "Duration|Registers Per|Issued Warp|No Eligible|Warp Cycles Per Issued|Compute \(SM\) Throughput|Memory Throughput|Executed Ipc A|Issue Slots Busy|L2 Hit|Stall|Warp Cycles Per Executed" $R/ncu_$m.txt | head -24
grep -iE "pipe|tensor|xu|fma|alu" $R/ncu_$m.txt | grep -E "%|utilization" | head -14
done
tar czf $OUT/call3.tgz -C $R . && rm -rf $R
