import csv, json, os, sys, statistics as st
R = sys.argv[1]
for rep in (1, 2):
    for i in (0, 1, 2, 3):
        tag = f"b{i}_{rep}"
        try:
            rows = json.load(open(f"{R}/{tag}/rope_write.json"))["rows"]
        except Exception as e:
            print(tag, "no json", e); continue
        line = []
        for r in rows:
            w, n = r.get("write"), r.get("rope_k+write (native)")
            if w and n:
                line.append(f"{r['format'][:2]}{r['tokens']}:{w:.2f}/{n:.2f}={n / w:.3f}")
        print(tag, " ".join(line))
for fmt in ("fp8", "nvfp4"):
    try:
        rows = list(csv.reader(open(f"{R}/ncu_{fmt}.csv")))
    except Exception as e:
        print(fmt, "no ncu", e); continue
    hdr_i = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    hdr = rows[hdr_i]; data = [r for r in rows[hdr_i + 2:] if len(r) == len(hdr)]
    k = hdr.index("Kernel Name")
    groups = {}
    for r in data:
        name = "write" if "NoRotation" in r[k] else "rope"
        groups.setdefault(name, []).append(r)
    metrics = [h for h in hdr if "__" in h]
    print(f"ncu {fmt} 4096 (median of {', '.join(f'{g}: {len(v)}' for g, v in groups.items())})")
    for m in metrics:
        j = hdr.index(m)
        vals = []
        for g in ("write", "rope"):
            try:
                vals.append(st.median(float(r[j].replace(",", "")) for r in groups.get(g, [])))
            except Exception:
                vals.append(float("nan"))
        short = m.replace("smsp__average_warps_issue_stalled_", "stall_").replace("_per_issue_active.ratio", "")
        print(f"  {short:70s} {vals[0]:14.3f} {vals[1]:14.3f}")
