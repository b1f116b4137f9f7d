# Per-round values: format tokens variant -> build: [rounds]
import json, glob, os, sys, collections
R = sys.argv[1]; fmts = sys.argv[2].split(",") if len(sys.argv) > 2 else None
d = collections.defaultdict(lambda: collections.defaultdict(list))
for path in sorted(glob.glob(f"{R}/b*_*/rope_write.json")):
    b = os.path.basename(os.path.dirname(path))
    for r in json.load(open(path))["rows"]:
        for k, v in r.items():
            if k == "write" or k.startswith("rope_k+write (native)"):
                d[(r["format"][:5], r["tokens"], k[-16:])][b.split("_")[0]].append((b.split("_")[1], round(v, 2)))
for key, per in d.items():
    if fmts and key[0] not in fmts: continue
    print(key, {b: [v for _, v in sorted(x)] for b, x in sorted(per.items())})
