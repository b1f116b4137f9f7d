"""Short table of rope_write rounds: us per variant and ratio to the write alone."""
import json, sys, glob, os
R = sys.argv[1]
short = {"write": "write", "rope_k+write (native)": "nat bf16", "rope_k+write (native), f32 tables": "nat f32",
         "rope_k+write (native), f32 half tables": "nat f32h", "rope_k+write (native), bf16 half tables": "nat bf16h",
         "rope_k+write, f32 half tables": "op f32h"}
for path in sorted(glob.glob(f"{R}/*/rope_write.json")):
    rows = json.load(open(path))["rows"]
    print(os.path.basename(os.path.dirname(path)))
    for r in rows:
        w = r.get("write")
        cells = []
        for k, s in short.items():
            v = r.get(k)
            if v is None:
                continue
            cells.append(f"{s} {v:.2f}" + (f" ({v / w:.3f})" if w and k != "write" else ""))
        print(f"  {r['format'][:5]:5s} {r['tokens']:6d} | " + " | ".join(cells))
