"""Does the order of the timed variants move the 64-token native rotary writes? (forty-fourth session, call e)"""
import sys
import torch
sys.path.insert(0, ".")
from benchmarks import common, rope_write as rw

V = {"write": rw._write,
     "op": lambda c: rw._fused(c, False),
     "triton": lambda c: rw._fused_as(c, False, None),
     "bf16": lambda c: rw._native(c, False),
     "op f32h": lambda c: rw._fused(c, False, "f32 half"),
     "f32h": lambda c: rw._native(c, False, "f32 half"),
     "f32": lambda c: rw._native(c, False, "f32"),
     "bf16h": lambda c: rw._native(c, False, "bf16 half")}
ORDERS = [["write", "f32h", "bf16h"],
          ["write", "op", "triton", "bf16", "op f32h", "f32h", "f32", "bf16h"],
          ["write", "op", "bf16", "op f32h", "f32h", "f32", "bf16h"],
          ["bf16h", "f32", "f32h", "bf16", "write"],
          ["write", "f32h", "bf16h"]]
for fmt in sys.argv[1].split(","):
    case = rw.Case(fmt, 64, common.rotations_for(rw.Case.bytes_per_call(64)))
    for order in ORDERS:
        res = {n: round(common.bench(V[n](case), trials=5).us, 2) for n in order}
        print(fmt, " ".join(f"{n}={v}" for n, v in res.items()), flush=True)
