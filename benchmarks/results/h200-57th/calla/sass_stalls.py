# Per-SASS-line warp-stall samples from `ncu --page source --csv --print-source sass` output.
# usage: sass_stalls.py FILE.csv [min_samples]
import csv, sys, collections
rows, kernels = [], []
cur = None
for rec in csv.reader(open(sys.argv[1])):
    if not rec: continue
    if rec[0] == "Kernel Name":
        cur = []; kernels.append((rec[1], cur)); continue
    if rec[0] == "Address":
        header = rec; continue
    if cur is not None:
        cur.append(dict(zip(header, rec)))
thr = int(sys.argv[2]) if len(sys.argv) > 2 else 20
for name, lines in kernels[:1]:
    print(name[:150])
# sum over the launches
agg = collections.OrderedDict()
for name, lines in kernels:
    for i, r in enumerate(lines):
        key = i
        a = agg.setdefault(key, {"src": r["Source"].strip(), "n": 0, "stalls": collections.Counter(), "exe": 0})
        a["n"] += int(r["# Samples"] or 0); a["exe"] += int(r["Instructions Executed"] or 0)
        for k, v in r.items():
            if k.startswith("stall_") and "Not Issued" not in k and v not in ("0", "", "-"):
                a["stalls"][k[6:]] += int(v)
tot = sum(a["n"] for a in agg.values())
warps = max(a["exe"] for a in agg.values())
print(f"launches {len(kernels)} lines {len(agg)} samples {tot} per-warp-launch {tot/ max(1, warps):.2f}")
cum = 0
for i, a in agg.items():
    cum += a["n"]
    if a["n"] >= thr:
        top = ", ".join(f"{k}:{v}" for k, v in a["stalls"].most_common(3))
        print(f"{i:4d} {a['n']:6d} {cum/tot*100:5.1f}% exe={a['exe']:5d} {a['src'][:60]:60s} {top}")
