"""ncu target: native FP8 decode at B64 ctx4096 and B16 ctx16384, one call each after a warm-up."""
import torch

from benchmarks.attention import MODES, decode_args
from kvfuse.ops import native
from kvfuse.ops.registry import AttentionCall

calls = [AttentionCall(*decode_args(MODES["fp8"], b, ctx)) for b, ctx in ((64, 4096), (16, 16384))]
for c in calls:
    native.paged_attention(c)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for c in calls:
    native.paged_attention(c)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
