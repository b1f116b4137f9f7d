import json, sys
h={r["kernel"]:r for r in json.load(open(sys.argv[1]+"/ptxas_native.json"))["rows"]}
m={r["kernel"]:r for r in json.load(open(sys.argv[2]+"/ptxas_native.json"))["rows"]}
n=0
for k in h:
    a,b=h[k],m.get(k)
    if (a["registers"],a["spill_stores"],a["stack_bytes"])!=(b["registers"],b["spill_stores"],b["stack_bytes"]):
        n+=1
        print(f"{a['registers']:3d}/{a['spill_stores']:3d} -> {b['registers']:3d}/{b['spill_stores']:3d}/{b['stack_bytes']}  {k[:170]}")
print(n, "changed of", len(h))
