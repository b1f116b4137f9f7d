"""A/B of native prefill builds: python ab_prefill.py LABEL (build chosen by env). One JSON line per case."""
import json, math, sys, torch
from benchmarks.attention import make_cache, _step_kv, HQ, HEAD, PAGE
from benchmarks.common import bench_cold_l2 as bench_us
from kvfuse.kv_cache import KVQuantMode
from kvfuse.ops.registry import AttentionCall
from kvfuse.ops import native

label = sys.argv[1]
modes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["fp8"]
M = {"bf16": KVQuantMode.NONE, "fp8": KVQuantMode.FP8_E4M3, "nvfp4": KVQuantMode.NVFP4}
for mode_name in modes:
    mode = M[mode_name]
    for name, batch, prefix, new in (("fresh16384", 1, 0, 16384),):
        ctx = prefix + new
        cache, bt = make_cache(mode, batch, ctx)
        q = torch.randn(batch * new, HQ, HEAD, device="cuda", dtype=torch.bfloat16)
        sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * new
        s = torch.tensor(0.5, device="cuda")
        kv = _step_kv(cache, bt, sl, new) if mode is KVQuantMode.NONE else (None, None)
        call = AttentionCall(q, cache, s, s, bt, sl, qsl, int(mode), 1 / math.sqrt(HEAD), None, key=kv[0], value=kv[1])
        us, _ = bench_us(lambda: native.prefill_attention(call), reps=60, graph=True)
        flops = 4 * HQ * HEAD * batch * new * (prefix + (new + 1) / 2)
        print(json.dumps(dict(label=label, mode=mode_name, case=name, us=round(us, 2), tflops=round(flops / us / 1e6, 1))), flush=True)
        del cache, q, kv, call
        torch.cuda.empty_cache()
