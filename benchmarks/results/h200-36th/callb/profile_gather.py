"""Kernel times inside one native FP8 / bf16 fresh prefill call (torch.profiler): the gather against the attention kernel."""
import json, math, sys, collections, torch
from torch.profiler import profile, ProfilerActivity
from benchmarks.attention import make_cache, _step_kv, HQ, HEAD
from kvfuse.kv_cache import KVQuantMode
from kvfuse.ops.registry import AttentionCall
from kvfuse.ops import native

out = {}
for mode_name, mode in (("fp8", KVQuantMode.FP8_E4M3), ("bf16", KVQuantMode.NONE)):
    for new in (4096, 16384):
        cache, bt = make_cache(mode, 1, new)
        q = torch.randn(new, HQ, HEAD, device="cuda", dtype=torch.bfloat16)
        sl = torch.full((1,), new, dtype=torch.int32, device="cuda")
        qsl = torch.tensor([0, new], dtype=torch.int32, device="cuda")
        s = torch.tensor(0.5, device="cuda")
        kv = _step_kv(cache, bt, sl, new) if mode is KVQuantMode.NONE else (None, None)
        call = AttentionCall(q, cache, s, s, bt, sl, qsl, int(mode), 1 / math.sqrt(HEAD), None, key=kv[0], value=kv[1])
        for _ in range(3):
            native.prefill_attention(call)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                native.prefill_attention(call)
            torch.cuda.synchronize()
        times = collections.defaultdict(list)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                times[e.name[:80]].append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
        row = {k: round(sum(v) / 5, 2) for k, v in times.items()}
        out[f"{mode_name} {new}"] = row
        print(mode_name, new, json.dumps(row), flush=True)
        del cache, q, kv, call
        torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1], "w"), indent=1)
