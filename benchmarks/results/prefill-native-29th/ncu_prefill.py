"""ncu target: one native prefill of N fresh tokens (mode bf16 / fp8), after a warm-up call."""
import math, sys, torch
from benchmarks.attention import make_cache, _step_kv, HQ, HEAD
from kvfuse.kv_cache import KVQuantMode
from kvfuse.ops.registry import AttentionCall
from kvfuse.ops import native
mode = {"bf16": KVQuantMode.NONE, "fp8": KVQuantMode.FP8_E4M3}[sys.argv[1]]
new = int(sys.argv[2])
cache, bt = make_cache(mode, 1, new)
q = torch.randn(new, HQ, HEAD, device="cuda", dtype=torch.bfloat16)
sl = torch.full((1,), new, dtype=torch.int32, device="cuda")
qsl = torch.tensor([0, new], dtype=torch.int32, device="cuda")
s = torch.tensor(0.5, device="cuda")
kv = _step_kv(cache, bt, sl, new) if mode is KVQuantMode.NONE else (None, None)
call = AttentionCall(q, cache, s, s, bt, sl, qsl, int(mode), 1 / math.sqrt(HEAD), None, key=kv[0], value=kv[1])
for _ in range(2):
    native.prefill_attention(call)
torch.cuda.synchronize()
