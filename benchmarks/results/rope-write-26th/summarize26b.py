import csv, sys, statistics as st, glob, os
R = sys.argv[1]
def _f(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return float("nan")
for fmt in ("fp8", "nvfp4"):
    cols = {}
    for i in (0, 1):
        try:
            rows = list(csv.reader(open(f"{R}/ncu_{i}_{fmt}.csv")))
            hdr_i = next(j for j, r in enumerate(rows) if "Kernel Name" in r)
        except Exception as e:
            print(fmt, i, "no ncu", e); continue
        hdr = rows[hdr_i]; data = [r for r in rows[hdr_i + 2:] if len(r) == len(hdr)]
        k = hdr.index("Kernel Name")
        for g in ("write", "rope"):
            sel = [r for r in data if ("NoRotation" in r[k]) == (g == "write")]
            if g == "write" and i == 1:
                continue
            cols[f"{g}{i}"] = {m: st.median(_f(r[hdr.index(m)]) for r in sel) if sel else float("nan")
                               for m in hdr if "__" in m}
            if sel: cols[f"{g}{i}"]["name"] = sel[0][k][:60]
    print(f"ncu {fmt} 4096: " + " | ".join(f"{c}: {v.get('name','')}" for c, v in cols.items()))
    metrics = [m for m in next(iter(cols.values())) if m != "name"] if cols else []
    for m in metrics:
        short = m.replace("smsp__average_warps_issue_stalled_", "stall_").replace("_per_issue_active.ratio", "")
        print(f"  {short:62s} " + " ".join(f"{cols[c][m]:14.3f}" for c in cols))
