"""As ab_nvfp4.py, timed as benchmarks.attention times decode (L2 flushed before each call): python ab_cold.py OUT.json B64_SPLITS B16_SPLITS [modes]"""
import json, sys
import torch
from benchmarks.attention import MODES, decode_args, kv_bytes
from benchmarks.common import bench_cold_l2, copy_bandwidth_gb_s
from kvfuse.ops import native
from kvfuse.ops.registry import AttentionCall

out_path, s64, s16 = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], [int(x) for x in sys.argv[3].split(",")]
copy = copy_bandwidth_gb_s()
rows = []
for mode in (sys.argv[4].split(",") if len(sys.argv) > 4 else ("fp8", "nvfp4")):
    cases = [tuple(int(x) for x in c.split(":")) for c in sys.argv[5].split(",")] if len(sys.argv) > 5 else [(64, 4096), (16, 16384)]
    for (b, ctx), splits in zip(cases, (s64, s16)):
        call = AttentionCall(*decode_args(MODES[mode], b, ctx))
        nbytes = kv_bytes(MODES[mode], b, ctx)
        for n in splits:
            us = bench_cold_l2(lambda: native.paged_attention(call, num_splits=n), reps=20)[0]
            row = dict(mode=mode, batch=b, context=ctx, splits=n, us=round(us, 2),
                       frac_of_copy=round(nbytes / us / 1e3 / copy, 3))
            rows.append(row)
            print(json.dumps(row), flush=True)
        del call
        torch.cuda.empty_cache()
json.dump(dict(copy_gb_per_s=copy, rows=rows), open(out_path, "w"), indent=1)
