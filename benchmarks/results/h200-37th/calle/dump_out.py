"""Outputs of the native prefill for fixed inputs (seeded), saved for a bit-exact comparison between builds."""
import math, sys, torch
from benchmarks.attention import make_cache, _step_kv, HQ, HEAD
from kvfuse.kv_cache import KVQuantMode
from kvfuse.ops.registry import AttentionCall
from kvfuse.ops import native

outs = {}
for mode_name, mode in (("fp8", KVQuantMode.FP8_E4M3), ("bf16", KVQuantMode.NONE)):
    for name, batch, prefix, new in (("fresh4099", 1, 0, 4099), ("chunked533", 3, 700, 533), ("fresh16384", 1, 0, 16384)):
        torch.manual_seed(1234)
        ctx = prefix + new
        cache, bt = make_cache(mode, batch, ctx)
        q = torch.randn(batch * new, HQ, HEAD, device="cuda", dtype=torch.bfloat16)
        sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * new
        s = torch.tensor(0.5, device="cuda")
        kv = _step_kv(cache, bt, sl, new) if mode is KVQuantMode.NONE else (None, None)
        call = AttentionCall(q, cache, s, s, bt, sl, qsl, int(mode), 1 / math.sqrt(HEAD), None, key=kv[0], value=kv[1])
        outs[f"{mode_name} {name}"] = native.prefill_attention(call).cpu()
torch.save(outs, sys.argv[1])
