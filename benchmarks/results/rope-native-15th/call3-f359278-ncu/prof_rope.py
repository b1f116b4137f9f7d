"""ncu target: the native write, the native rotary write and Triton's, one call each, on one
benchmark case (python .scratch/prof_rope.py FMT TOKENS), profiled between cudaProfilerStart/Stop."""
import sys

import torch

from benchmarks.rope_write import Case, _fused_as, _native, _write

fmt, T = sys.argv[1], int(sys.argv[2])
case = Case(fmt, T, 1)
calls = [_write(case)[0], _native(case, False)[0], _fused_as(case, False, None)[0]]
for f in calls:
    f()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for f in calls:
    f()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
