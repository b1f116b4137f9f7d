"""A/B timing of the native cache writes: python ab_write.py OUT.json FORMATS TOKENS [slots]."""
import json, os, sys
import torch
from benchmarks import cache_write as cw, common

out, formats, tokens = sys.argv[1], sys.argv[2].split(","), [int(t) for t in sys.argv[3].split(",")]
slots = sys.argv[4] if len(sys.argv) > 4 else "random"
import kvfuse  # noqa
from kvfuse.ops import native
native.build_info(build=True)
src = torch.empty((1 << 30) // 4, dtype=torch.int32, device="cuda")
dst = torch.empty_like(src)
copy = 2 * (1 << 30) / (common.bench([lambda: dst.copy_(src)], trials=10, min_ms=20.0).us * 1e-6) / 1e9
del src, dst
rows = []
for fmt in formats:
    for n in tokens:
        case = cw.Case(fmt, n, common.rotations_for(cw.Case.bytes_per_call(fmt, n)), slots=slots)
        cache = case.new_cache()
        calls = cw.make_kvfuse_native(case, cache)
        per_graph = int(os.environ.get("AB_GRAPH_CALLS", "0"))
        calls = [calls[i % len(calls)] for i in range(max(per_graph, len(calls)))]
        t = common.bench(calls)
        gbs = case.effective_bytes / (t.us * 1e-6) / 1e9
        rows.append({"flags": os.environ.get("KVFUSE_NATIVE_CUDA_FLAGS", ""), "format": fmt, "tokens": n,
                     "graph_calls": len(calls), "us": round(t.us, 3), "pct_copy": round(100 * gbs / copy, 2), "copy_gb_s": round(copy, 1)})
        print(json.dumps(rows[-1]), flush=True)
        del case, cache
        torch.cuda.empty_cache()
with open(out, "w") as f:
    json.dump(rows, f, indent=1)
