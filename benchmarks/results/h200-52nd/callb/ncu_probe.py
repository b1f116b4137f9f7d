# Launches the NVFP4 write alone or the native rotary write (full-width bf16 / bf16 half / f32 half
# tables) of T tokens N rounds over 8 input sets, for ncu.
import sys
import torch
from benchmarks import rope_write as rw

case = rw.Case("nvfp4", int(sys.argv[3]), 8)
calls = {"write": rw._write(case), "full": rw._native(case, False, "bf16"),
         "bhalf": rw._native(case, False, "bf16 half"), "fhalf": rw._native(case, False, "f32 half")}[sys.argv[1]]
for _ in range(int(sys.argv[2])):
    for c in calls:
        c()
torch.cuda.synchronize()
print("ok", sys.argv[1:])
