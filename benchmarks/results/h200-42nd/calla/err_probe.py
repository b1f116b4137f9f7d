"""Error of the native e4m3 prefill against the float64 reference, by query scale (build chosen by env)."""
import json, sys, torch
sys.path.insert(0, "tests/ops")
from test_triton_attention import make_case, reference_out
from test_quantized_prefill import fp8_dots_bound
from kvfuse.kv_cache import KVQuantMode
from kvfuse.ops import native
from kvfuse.ops.registry import AttentionCall
label = sys.argv[1]
for seq, q in (([4099, 900], [4099, 533]), ([8300], [700])):
    for mult in (0.01, 1.0, 8.0, 40.0):
        args = make_case(seq, q, 8, 2, 128, KVQuantMode.FP8_E4M3, seed=91)
        args["query"] = args["query"] * mult
        expected = reference_out(args).float()
        out = native.prefill_attention(AttentionCall(**args)).float().cpu()
        n = int(args["query_start_loc"][-1])
        err = (out[:n] - expected[:n]).abs()
        mb, xb = fp8_dots_bound(args)
        print(json.dumps(dict(label=label, seq=seq, mult=mult, mean=float(err.mean()), max=float(err.max()),
                              mean_bound=mb, max_bound=xb, finite=bool(torch.isfinite(out).all()))), flush=True)
