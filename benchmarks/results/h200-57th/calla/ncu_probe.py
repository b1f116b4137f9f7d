# Launches the write alone or the native rotary write (full-width bf16 / bf16 half / f32 half
# tables) of FORMAT at T tokens, N rounds over the case's input sets, for ncu.
# usage: ncu_probe.py VARIANT ROUNDS TOKENS FORMAT
import sys
import torch
from benchmarks import rope_write as rw

case = rw.Case(sys.argv[4], int(sys.argv[3]), 8)
calls = {"write": lambda: rw._write(case), "full": lambda: rw._native(case, False, "bf16"),
         "bhalf": lambda: rw._native(case, False, "bf16 half"),
         "fhalf": lambda: rw._native(case, False, "f32 half")}[sys.argv[1]]()
for _ in range(int(sys.argv[2])):
    for c in calls:
        c()
torch.cuda.synchronize()
print("ok", sys.argv[1:], len(calls))
