"""Accuracy of the native e4m3 prefill (build chosen by env): constant values, and values of mean 1
against the float64 reference. One JSON line per case."""
import json, sys, torch
sys.path.insert(0, "tests/ops")
from test_triton_attention import make_case, reference_out
from kvfuse.kv_cache import KVQuantMode
from kvfuse.ops import native
from kvfuse.ops.registry import AttentionCall
label = sys.argv[1]
for seq, q in (([8300], [700]), ([4099], [4099]), ([900], [533])):
    for kind in ("ones", "mean1", "randn", "step_old", "step_new", "ramp"):
        args = make_case(seq, q, 8, 2, 128, KVQuantMode.FP8_E4M3, seed=81)
        cache = args["kv_cache"]
        g = torch.Generator(device="cuda").manual_seed(5)
        shape = cache[:, 1].shape
        if kind == "ones":
            cache[:, 1] = torch.ones(shape, device="cuda").to(cache.dtype)
        elif kind == "mean1":
            cache[:, 1] = (1 + 0.5 * torch.randn(shape, device="cuda", generator=g)).to(cache.dtype)
        elif kind in ("step_old", "step_new", "ramp"):
            # values by key position: 2 for the older half of the sequence and 0 for the newer
            # (step_old), the reverse (step_new), or 4 * position / length (ramp)
            bs = cache.shape[2]
            pos = torch.arange(seq[0], device="cuda")
            blk = args["block_table"][0][pos // bs].long()
            off = pos % bs
            frac = pos.float() / seq[0]
            val = {"step_old": (frac < 0.5).float() * 2, "step_new": (frac >= 0.5).float() * 2, "ramp": 4 * frac}[kind]
            v = cache[:, 1].float()
            v[blk, off] = val[:, None, None].expand(-1, v.shape[2], v.shape[3]).clone()
            cache[:, 1] = v.to(cache.dtype)
        if label == "triton":
            from kvfuse.ops.triton.attention import paged_attention as triton_attention
            out = triton_attention(AttentionCall(**args), fp8_dots=True).float().cpu()
        else:
            out = native.prefill_attention(AttentionCall(**args)).float().cpu()
        ref = reference_out(args).float()
        cov = int(args["query_start_loc"][-1])
        d = (out - ref)[:cov]
        rel = (d.sum(-1) / ref[:cov].abs().sum(-1).clamp_min(1e-6))  # signed, per row and head
        last = d[-64:]  # the rows that see the most keys
        print(json.dumps(dict(label=label, seq=seq[0], q=q[0], kind=kind, max_abs=round(d.abs().max().item(), 5),
                              mean_abs=round(d.abs().mean().item(), 6), mean_signed_rel=round(rel.mean().item(), 6),
                              last_rows_signed_rel=round((last.sum(-1) / ref[:cov][-64:].abs().sum(-1)).mean().item(), 6))), flush=True)
