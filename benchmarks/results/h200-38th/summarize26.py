"""Compact A/B table: per (format, tokens), each build's us (min of rounds) and ratio to its write."""
import json, sys, glob, os, collections
R = sys.argv[1]
short = {"rope_k+write (native)": "bf16", "rope_k+write (native), f32 tables": "f32",
         "rope_k+write (native), f32 half tables": "f32h", "rope_k+write (native), bf16 half tables": "bf16h",
         "rope_k+write, f32 half tables": "op f32h", "rope_qk+write, f32 half tables": "qk op f32h",
         "rope_qk+write (triton), f32 half tables": "qk tri f32h", "rope_qk+write (native), f32 half tables": "qk nat f32h"}
data = collections.defaultdict(lambda: collections.defaultdict(list))
builds = set()
for path in sorted(glob.glob(f"{R}/b*_*/rope_write.json")):
    b = os.path.basename(os.path.dirname(path)).split("_")[0]
    builds.add(b)
    for r in json.load(open(path))["rows"]:
        for k, v in r.items():
            if k == "write" or k in short:
                data[(r["format"][:5], r["tokens"])][(b, k)].append(v)
builds = sorted(builds)
keys = [k for k in short if any((b, k) in d for d in data.values() for b in builds)]
print("format tokens | " + " | ".join(f"{b}: write " + " ".join(short[k] for k in keys) for b in builds))
for (fmt, tok), d in data.items():
    cells = []
    for b in builds:
        w = min(d.get((b, "write"), [float("nan")]))
        cells.append(f"{w:6.2f} " + " ".join(f"{min(d.get((b, k), [float('nan')])):6.2f}({min(d.get((b, k), [float('nan')])) / w:.2f})" for k in keys))
    print(f"{fmt:5s} {tok:6d} | " + " | ".join(cells))
