"""Native NVFP4 / FP8 decode at B64 ctx4096 and B16 ctx16384 with given split counts:
python ab_nvfp4.py OUT.json B64_SPLITS,.. B16_SPLITS,.. (CUDA-graph medians, benchmarks.common.bench)."""
import json, sys
import torch
from benchmarks.attention import MODES, decode_args, kv_bytes
from benchmarks.common import bench, copy_bandwidth_gb_s
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
            us = bench([lambda: native.paged_attention(call, num_splits=n)]).us
            row = dict(mode=mode, batch=b, context=ctx, splits=n, us=round(us, 2),
                       frac_of_copy=round(nbytes / us / 1e3 / copy, 3))
            rows.append(row)
            print(json.dumps(row), flush=True)
        del call
        torch.cuda.empty_cache()
json.dump(dict(copy_gb_per_s=copy, rows=rows), open(out_path, "w"), indent=1)
