import csv, sys, collections
path = sys.argv[1]; cuts = [int(x) for x in sys.argv[2].split(",")]; names = sys.argv[3].split(",")
rows = list(csv.reader(open(path, errors="replace")))
hi = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
hdr = rows[hi]; data = [r for r in rows[hi + 1:] if len(r) == len(hdr)]
H = {c: i for i, c in enumerate(hdr)}
num = lambda x: float(x.replace(",", "")) if x not in ("", "-") else 0.0
S = H["Warp Stall Sampling (All Samples)"]; IE = H["Instructions Executed"]
reasons = [c for c in hdr if c.startswith("stall_") and "(Not Issued)" not in c]
tot = sum(num(r[S]) for r in data)
bounds = [0] + cuts + [len(data)]
for k in range(len(bounds) - 1):
    seg = data[bounds[k]:bounds[k + 1]]
    s = sum(num(r[S]) for r in seg); ie = sum(num(r[IE]) for r in seg)
    agg = collections.Counter({c[6:]: sum(num(r[H[c]]) for r in seg) for c in reasons})
    print(f"{names[k] if k < len(names) else k:14s} [{bounds[k]:5d},{bounds[k+1]:5d}) {100*s/tot:5.1f}% samples, inst {ie/1e6:7.1f}M | " + ", ".join(f"{a} {100*v/tot:.1f}" for a, v in agg.most_common(6) if v))
