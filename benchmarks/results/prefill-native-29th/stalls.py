import csv, sys, collections
path = sys.argv[1]; ntop = int(sys.argv[2]) if len(sys.argv) > 2 else 50
rows = list(csv.reader(open(path, errors="replace")))
hi = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
hdr = rows[hi]; data = [r for r in rows[hi + 1:] if len(r) == len(hdr)]
H = {c: i for i, c in enumerate(hdr)}
num = lambda x: float(x.replace(",", "")) if x not in ("", "-") else 0.0
S = H["Warp Stall Sampling (All Samples)"]; NI = H["Warp Stall Sampling (Not-issued Samples)"]; IE = H["Instructions Executed"]
reasons = [c for c in hdr if c.startswith("stall_") and "(Not Issued)" not in c]
tot = sum(num(r[S]) for r in data); tot_ni = sum(num(r[NI]) for r in data); ie = sum(num(r[IE]) for r in data)
print(f"{path}: {len(data)} instr, samples {tot:.0f}, not issued {tot_ni:.0f} ({100*tot_ni/tot:.1f}%), inst executed {ie:.0f}")
agg = collections.Counter({c: sum(num(r[H[c]]) for r in data) for c in reasons})
print("  reasons (all samples):", ", ".join(f"{k[6:]} {100*v/tot:.1f}%" for k, v in agg.most_common(12) if v))
order = sorted(range(len(data)), key=lambda j: -num(data[j][S]))
for j in order[:ntop]:
    r = data[j]
    top = sorted(((num(r[H[c]]), c[6:]) for c in reasons), reverse=True)[:3]
    print(f"{j:5d} {100*num(r[S])/tot:5.2f}% ie={num(r[IE]):9.0f} {r[H['Source']].strip()[:64]:64s} " + " ".join(f"{h}={100*v/tot:.2f}" for v, h in top if v))
