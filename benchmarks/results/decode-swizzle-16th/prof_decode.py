"""ncu target: native decode attention, FP8 B64 ctx4096, FP8 B16 ctx16384, NVFP4 B64 ctx4096, and
the Triton bf16 kernel at B64 ctx4096 (python .scratch/prof_decode.py), between cudaProfilerStart/Stop."""
import torch

from benchmarks.attention import MODES, decode_args
from kvfuse.ops import native
from kvfuse.ops.registry import AttentionCall
from kvfuse.ops.triton import attention as ta

calls = []
for mode, b, ctx in (("fp8", 64, 4096), ("fp8", 16, 16384), ("nvfp4", 64, 4096)):
    call = AttentionCall(*decode_args(MODES[mode], b, ctx))
    calls.append(lambda call=call: native.paged_attention(call))
bcall = AttentionCall(*decode_args(MODES["bf16"], 64, 4096))
calls.append(lambda: ta.paged_attention(bcall))
for f in calls:
    f()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for f in calls:
    f()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
