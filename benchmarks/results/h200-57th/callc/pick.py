# Reads summarize-style rope_write JSON dirs of builds f and ks; prints "ks" if ks's median ratios
# are lower by >= 0.01 on average at 64 and 256 tokens and no worse than +0.005 at 1024 and 4096.
import json, glob, os, sys, statistics, collections
R = sys.argv[1]
rat = collections.defaultdict(list)
for f in glob.glob(os.path.join(R, "b*_*", "rope_write.json")):
    b = os.path.basename(os.path.dirname(f))[1:].rsplit("_", 1)[0]
    for row in json.load(open(f))["rows"]:
        for k in ("native rope_k+write / write", "native bf16 half tables / write", "native f32 half tables / write"):
            if row.get(k) is not None:
                rat[(b, row["tokens"], k)].append(row[k])
def d(t):
    return [statistics.mean(rat[("ks", t, k)]) - statistics.mean(rat[("f", t, k)])
            for (b, tt, k) in list(rat) if b == "f" and tt == t]
small = d(64) + d(256)
large = d(1024) + d(4096)
print("ks" if small and statistics.mean(small) <= -0.01 and max(large) <= 0.005 else "f",
      "small", [round(x, 3) for x in small], "large", [round(x, 3) for x in large], file=sys.stderr)
print("ks" if small and statistics.mean(small) <= -0.01 and max(large) <= 0.005 else "f")
