# Launches the bf16 64-token write alone or the native rotary write (float32 half tables) N rounds
# over 8 input sets, for ncu.
import sys
import torch
from benchmarks import rope_write as rw

case = rw.Case(sys.argv[3] if len(sys.argv) > 3 else "bfloat16", int(sys.argv[4]) if len(sys.argv) > 4 else 64, 8)
calls = {"write": rw._write(case), "rot": rw._native(case, False, "f32 half"),
         "rotb": rw._native(case, False, "bf16 half")}[sys.argv[1]]
for _ in range(int(sys.argv[2])):
    for c in calls:
        c()
torch.cuda.synchronize()
print("ok", sys.argv[1:])
