"""Is the 64-token rotary write's two-level time the graph's replay boundary? The same calls timed
in graphs of 16, 64 and 256 calls (benchmarks.common.MIN_GRAPH_CALLS), rounds interleaved.
python probe_graph.py OUT.json"""
import json, sys, torch
from benchmarks import common, rope_write as rw
out = {}
VAR = {"write": lambda c: rw._write(c), "full": lambda c: rw._native(c, False, "bf16"),
       "bf16 half": lambda c: rw._native(c, False, "bf16 half"), "f32 half": lambda c: rw._native(c, False, "f32 half")}
for fmt in ("bfloat16", "fp8", "nvfp4"):
    T = 64
    case = rw.Case(fmt, T, common.rotations_for(rw.Case.bytes_per_call(T)))
    rows = []
    for rnd in range(3):
        for n in (16, 64, 256):
            common.MIN_GRAPH_CALLS = n
            row = {"round": rnd, "calls": n}
            for name, make in VAR.items():
                row[name] = round(common.bench(make(case), trials=5).us, 3)
            rows.append(row)
            print(fmt, row, flush=True)
    out[fmt] = rows
json.dump(out, open(sys.argv[1], "w"), indent=1)
