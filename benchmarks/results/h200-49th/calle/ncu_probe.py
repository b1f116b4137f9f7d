# Launches the FP8 4096-token native rotary write over full-width bf16 tables ("full") or float32
# half tables ("half32") N rounds over the benchmark's input sets, for ncu.
import sys
import torch
from benchmarks import rope_write as rw

case = rw.Case("fp8", 4096, 8)
calls = {"full": rw._native(case, False, "bf16"), "half32": rw._native(case, False, "f32 half")}[sys.argv[1]]
for _ in range(int(sys.argv[2])):
    for c in calls:
        c()
torch.cuda.synchronize()
print("ok", sys.argv[1:])
