"""Interleaved rope_write runs: R/b<build>_<round>/rope_write.json -> per (format, tokens), per build
and process round: write us, then each rotary variant's us and its paired ratio median [lo-hi]."""
import json, sys, glob, os, collections
R = sys.argv[1]
rows = collections.defaultdict(dict)  # (fmt, tok) -> {(build, round): row}
for f in sorted(glob.glob(os.path.join(R, "b*_*", "rope_write.json"))):
    b, r = os.path.basename(os.path.dirname(f))[1:].rsplit("_", 1)
    for row in json.load(open(f))["rows"]:
        rows[(row["format"], row["tokens"])][(b, r)] = row
RAT = {"rope_k+write (native)": "native rope_k+write / write",
       "rope_k+write (native), bf16 half tables": "native bf16 half tables / write",
       "rope_k+write (native), f32 half tables": "native f32 half tables / write"}
print("fmt tokens build/round | write | full | bf16 half | f32 half   (us, paired ratio median [range])")
for (f, t), byrun in sorted(rows.items()):
    for (b, r), row in sorted(byrun.items()):
        cells = [f"{row.get('write', float('nan')):.2f}"]
        for v, rk in RAT.items():
            if row.get(v) is None: cells.append("-"); continue
            lo, hi = row.get(rk + " range", [None, None])
            cells.append(f"{row[v]:.2f} {row.get(rk, float('nan')):.3f} [{lo}-{hi}]")
        print(f"{f:8s} {t:5d} {b:>4s}/{r} | " + " | ".join(cells))
