"""SM clock and power while one prefill case runs back to back (build chosen by env):
python clock_probe.py LABEL MODE TOKENS SECONDS. Samples nvidia-smi every 100 ms; one JSON line."""
import json, math, subprocess, sys, time, torch
from benchmarks.attention import make_cache, _step_kv, HQ, HEAD
from kvfuse.kv_cache import KVQuantMode
from kvfuse.ops import native
from kvfuse.ops.registry import AttentionCall

label, mode_name, new, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
mode = {"bf16": KVQuantMode.NONE, "fp8": KVQuantMode.FP8_E4M3}[mode_name]
cache, bt = make_cache(mode, 1, new)
q = torch.randn(new, HQ, HEAD, device="cuda", dtype=torch.bfloat16)
sl = torch.full((1,), new, dtype=torch.int32, device="cuda")
qsl = torch.tensor([0, new], dtype=torch.int32, device="cuda")
s = torch.tensor(0.5, device="cuda")
kv = _step_kv(cache, bt, sl, new) if mode is KVQuantMode.NONE else (None, None)
call = AttentionCall(q, cache, s, s, bt, sl, qsl, int(mode), 1 / math.sqrt(HEAD), None, key=kv[0], value=kv[1])
native.prefill_attention(call)
torch.cuda.synchronize()
smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
                        "-lms", "100"], stdout=subprocess.PIPE, text=True)
start, calls = time.time(), 0
ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
ev0.record()
while time.time() - start < seconds:
    for _ in range(20):
        native.prefill_attention(call)
    calls += 20
    torch.cuda.synchronize()
ev1.record(); torch.cuda.synchronize()
smi.terminate()
rows = [l.split(",") for l in smi.communicate()[0].strip().splitlines() if l.count(",") == 2]
samples = [(float(a), float(b), float(c)) for a, b, c in rows][5:]  # past the ramp-up
clocks = sorted(x[0] for x in samples)
power = sorted(x[1] for x in samples)
print(json.dumps(dict(label=label, mode=mode_name, tokens=new, us_per_call=round(ev0.elapsed_time(ev1) * 1e3 / calls, 1),
                      samples=len(samples), sm_clock_median=clocks[len(clocks) // 2], sm_clock_min=clocks[0],
                      power_median=power[len(power) // 2], power_max=power[-1], temp_max=max(x[2] for x in samples))))
