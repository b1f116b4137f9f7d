import math, sys, torch
from benchmarks.attention import make_cache, _step_kv, HQ, HEAD
from kvfuse.kv_cache import KVQuantMode
from kvfuse.ops.registry import AttentionCall
from kvfuse.ops import native
tokens = int(sys.argv[1])
mode = {"bf16": KVQuantMode.NONE, "fp8": KVQuantMode.FP8_E4M3}[sys.argv[2]]
cache, bt = make_cache(mode, 1, tokens)
q = torch.randn(tokens, HQ, HEAD, device="cuda", dtype=torch.bfloat16)
sl = torch.tensor([tokens], dtype=torch.int32, device="cuda")
qsl = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
s = torch.tensor(0.5, device="cuda")
kv = _step_kv(cache, bt, sl, tokens) if mode is KVQuantMode.NONE else (None, None)
call = AttentionCall(q, cache, s, s, bt, sl, qsl, int(mode), 1 / math.sqrt(HEAD), None, key=kv[0], value=kv[1])
for _ in range(3):
    native.prefill_attention(call)
torch.cuda.synchronize()
