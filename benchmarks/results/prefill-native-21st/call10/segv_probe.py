"""Which native CPU refusals crash on this host: python3 segv_probe.py CASE (one case per process)."""
import faulthandler, sys
import torch
faulthandler.enable()
from kvfuse.ops import native
native.build_info(build=True)
op = torch.ops.kvfuse_native
case = sys.argv[1]
x = torch.randn(3, 2, 64, dtype=torch.bfloat16)
one = torch.ones(())
try:
    if case == "mode":        # message: ints and names only
        op.encode_kv(x, one, 4, torch.uint8)
    elif case == "scale":     # message prints sizes, dtype, device
        op.encode_kv(x, torch.ones(4), 1, torch.float8_e4m3fn)
    elif case == "input":     # message prints sizes and dtype
        op.encode_kv(torch.randn(3, 2, 64, dtype=torch.float64), one, 1, torch.float8_e4m3fn)
    elif case == "cache":     # message prints sizes and strides
        cache = torch.zeros(4, 2, 2, 16, 36, dtype=torch.uint8).transpose(2, 3)
        op.encode_and_cache_write(x, x, cache, torch.arange(3), one, one, 3)
    elif case == "cuda_scale":
        op.encode_kv(x.cuda(), torch.ones(4, device="cuda"), 1, torch.float8_e4m3fn)
    print(case, "no exception")
except Exception as e:
    print(case, type(e).__name__, str(e).splitlines()[0][:160])
