"""Is the slow state of the 64-token writes (forty-fifth session, call b) a lower SM clock? Before and after each
round, the effective SM clock from torch.cuda._sleep (a spin of a known cycle count, timed with events); rounds
plain, then rounds each preceded by a 20 ms spin."""
import sys
import time
import torch
sys.path.insert(0, ".")
from benchmarks import common, rope_write as rw

V = {"write": rw._write,
     "f32h": lambda c: rw._native(c, False, "f32 half"),
     "bf16h": lambda c: rw._native(c, False, "bf16 half")}
case = rw.Case("bfloat16", 64, common.rotations_for(rw.Case.bytes_per_call(64)))
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def mhz(cycles=200_000):
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


t0 = time.time()


def rnd(tag, spin_ms):
    before = []
    out = []
    for n in V:
        if spin_ms:
            torch.cuda._sleep(int(spin_ms * 1.98e6))
        before.append(mhz())
        t = common.bench(V[n](case), trials=5)
        out.append(f"{n}={t.us:.2f}{'' if t.graphed else '(eager)'}")
    print(f"{time.time() - t0:6.2f}s {tag}: " + " ".join(out) + "  MHz before each: " +
          " ".join(f"{m:.0f}" for m in before) + f", after: {mhz():.0f}", flush=True)


for i in range(10):
    rnd(f"plain {i}", 0)
for i in range(10):
    rnd(f"20 ms spin {i}", 20)
for i in range(4):
    rnd(f"plain {i}", 0)
