"""Max |out - 1| of the native e4m3 prefill with every value 1 (the constant-values test's cases)."""
import sys, torch
sys.path.insert(0, "tests/ops")
from test_native_prefill import LONG_FP8, SHORT_FP8
from test_triton_attention import make_case
from kvfuse.kv_cache import KVQuantMode
from kvfuse.ops import native
from kvfuse.ops.registry import AttentionCall
for name, case in (("long", LONG_FP8), ("short", SHORT_FP8)):
    for seed in (71, 72, 73):
        args = make_case(*case, 8, 2, 128, KVQuantMode.FP8_E4M3, pad_rows=3, seed=seed)
        cache = args["kv_cache"]
        cache[:, 1] = torch.ones(cache[:, 1].shape, device=cache.device).to(cache.dtype)
        args["v_scale"] = torch.tensor(1.0, device="cuda")
        out = native.prefill_attention(AttentionCall(**args)).float()
        cov = int(args["query_start_loc"][-1])
        d = out[:cov] - 1.0
        print(name, seed, "max", d.abs().max().item(), "mean", d.mean().item(), flush=True)
