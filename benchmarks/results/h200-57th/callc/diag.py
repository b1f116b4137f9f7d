# Interleaved timing (15 rounds) of the FP8 write alone and the native rotary write (three table
# forms) at the given token counts, without rope_write's bit-exactness check (diagnostic builds).
# usage: diag.py OUT.json TOKENS...
import json, sys
from benchmarks import common, rope_write as rw

out = []
for tokens in [int(t) for t in sys.argv[2:]]:
    case = rw.Case("fp8", tokens, common.rotations_for(rw.Case.bytes_per_call(tokens)), scales=(0.5, 0.25))
    calls = {"write": rw._write(case), "full": rw._native(case, False, "bf16"),
             "bhalf": rw._native(case, False, "bf16 half"), "fhalf": rw._native(case, False, "f32 half")}
    t = common.bench_interleaved(calls, rounds=15)
    row = {"tokens": tokens, "write": t.median("write")}
    for n in ("full", "bhalf", "fhalf"):
        row[n] = t.median(n)
        row[n + " ratio"] = t.ratio(n, "write")
    out.append(row)
    print(tokens, f"write {row['write']:.3f}", " ".join(
        f"{n} {row[n]:.3f} {row[n + ' ratio'][0]:.3f} [{row[n + ' ratio'][1]:.3f}-{row[n + ' ratio'][2]:.3f}]"
        for n in ("full", "bhalf", "fhalf")), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
