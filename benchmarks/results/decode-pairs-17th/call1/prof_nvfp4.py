"""ncu target: native NVFP4 decode at B64 ctx4096 and B16 ctx16384, between cudaProfilerStart/Stop."""
import torch

from benchmarks.attention import MODES, decode_args
from kvfuse.ops import native
from kvfuse.ops.registry import AttentionCall

calls = []
for b, ctx in ((64, 4096), (16, 16384)):
    call = AttentionCall(*decode_args(MODES["nvfp4"], b, ctx))
    calls.append(lambda call=call: native.paged_attention(call))
for f in calls:
    f()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for f in calls:
    f()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
