# Per-instruction warp-stall samples from `ncu --page source --csv --print-source sass` (first kernel
# block of the file, or the one whose index is argv[2]); prints instructions with samples.
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
blocks, cur = [], None
for r in rows:
    if r and r[0] == "Kernel Name":
        cur = {"name": r[1], "rows": []}; blocks.append(cur); continue
    if r and r[0] == "Address":
        cur["hdr"] = r; continue
    if cur is not None and r: cur["rows"].append(r)
b = blocks[int(sys.argv[2]) if len(sys.argv) > 2 else 0]
h = b["hdr"]
ia, isrc, iall = h.index("Address"), h.index("Source"), h.index("Warp Stall Sampling (All Samples)")
iex = h.index("Instructions Executed")
stall_cols = [i for i, c in enumerate(h) if c.startswith("stall_") and "Not Issued" not in c]
tot = sum(float(r[iall] or 0) for r in b["rows"])
print(b["name"][:160], "kernels in file:", len(blocks), "total samples", tot)
agg = {}
for n, r in enumerate(b["rows"]):
    s = float(r[iall] or 0)
    parts = sorted(((float(r[i] or 0), h[i][6:]) for i in stall_cols), reverse=True)
    for v, k in parts: agg[k] = agg.get(k, 0) + v
    if s > 0 or "LDG" in r[isrc] or "STG" in r[isrc] or "ACQ" in r[isrc]:
        top = " ".join(f"{k}:{v:.0f}" for v, k in parts[:3] if v > 0)
        print(f"{n:4d} {r[isrc][:60]:60s} ex={r[iex]:>6s} samp={s:5.0f} {top}")
print("by reason:", sorted(((round(v), k) for k, v in agg.items() if v), reverse=True))
