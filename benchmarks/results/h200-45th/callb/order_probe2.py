"""What slows every 64-token write after some variants have run (forty-fourth session's 'not explained',
forty-fifth's order probe)? The native variants alone, many rounds; then the op over f32 half tables once;
then the native variants again. Each line: seconds since start, the variant's us, and whether a graph timed it."""
import sys
import time
import torch
sys.path.insert(0, ".")
from benchmarks import common, rope_write as rw

V = {"write": rw._write,
     "op": lambda c: rw._fused(c, False),
     "bf16": lambda c: rw._native(c, False),
     "op f32h": lambda c: rw._fused(c, False, "f32 half"),
     "f32h": lambda c: rw._native(c, False, "f32 half"),
     "bf16h": lambda c: rw._native(c, False, "bf16 half")}
t0 = time.time()
case = rw.Case("bfloat16", 64, common.rotations_for(rw.Case.bytes_per_call(64)))


def rnd(names, tag):
    out = []
    for n in names:
        t = common.bench(V[n](case), trials=5)
        out.append(f"{n}={t.us:.2f}{'' if t.graphed else '(eager)'}")
    print(f"{time.time() - t0:6.1f}s {tag}: " + " ".join(out), flush=True)


for i in range(int(sys.argv[1])):
    rnd(["write", "f32h", "bf16h"], f"native {i}")
rnd(["op"], "op")
rnd(["write", "f32h", "bf16h"], "after op")
rnd(["op f32h"], "op f32h")
for i in range(3):
    rnd(["write", "f32h", "bf16h"], f"after op f32h {i}")
