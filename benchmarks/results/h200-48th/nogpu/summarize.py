"""Minimum over rounds per build: R/b<build>_<round>/rope_write.json -> table."""
import json, sys, glob, os, collections
R = sys.argv[1]
cols = sys.argv[2].split(";") if len(sys.argv) > 2 else None
data = collections.defaultdict(lambda: collections.defaultdict(list))  # build -> (fmt,tok,var) -> [us]
variants = []
for f in sorted(glob.glob(os.path.join(R, "b*_*", "rope_write.json"))):
    b = os.path.basename(os.path.dirname(f)).rsplit("_", 1)[0]
    for row in json.load(open(f))["rows"]:
        for k, v in row.items():
            if k in ("tokens", "format") or "/" in k or not isinstance(v, (int, float)):
                continue
            if k not in variants: variants.append(k)
            data[b][(row["format"], row["tokens"], k)].append(v)
cols = cols or variants
short = {v: v.replace("rope_k+write", "rk").replace(" (native)", "n").replace(" tables", "") for v in cols}
builds = sorted(data)
keys = sorted({(f, t) for b in builds for (f, t, _) in data[b]})
print("fmt tokens | " + " | ".join(f"{b}: " + " ".join(short[c] for c in cols) for b in builds))
for f, t in keys:
    cells = []
    for b in builds:
        w = min(data[b].get((f, t, "write"), [float("nan")]))
        parts = []
        for c in cols:
            v = data[b].get((f, t, c))
            if not v: parts.append("-"); continue
            m = min(v)
            parts.append(f"{m:.2f}" if c == "write" else f"{m:.2f}({m / w:.2f})")
        cells.append(" ".join(parts))
    print(f"{f:6s} {t:6d} | " + " | ".join(cells))
# spread per build (max-min over rounds)
for b in builds:
    sp = [max(v) - min(v) for v in data[b].values() if len(v) > 1]
    if sp: print(f"{b}: rounds spread max {max(sp):.2f} us, median {sorted(sp)[len(sp)//2]:.2f}")
