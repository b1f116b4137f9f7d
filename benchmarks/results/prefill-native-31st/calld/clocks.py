"""Per run of call d: SM clock and board power from nvidia-smi's 20 ms samples (those above 250 W,
i.e. while kernels ran), and the us per call: python clocks.py calld"""
import collections, glob, json, statistics, sys

R = sys.argv[1]
us = collections.defaultdict(list)
for line in open(f"{R}/ab.jsonl"):
    r = json.loads(line)
    us[r["mode"]].append(r["us"])
for mode in ("bf16", "fp8"):
    for path in sorted(glob.glob(f"{R}/smi_{mode}_*.csv")):
        clk, watts = [], []
        for line in open(path):
            p = [x.strip() for x in line.split(",")]
            try:
                c, w = float(p[1]), float(p[2])
            except (IndexError, ValueError):
                continue
            if w > 250:
                clk.append(c)
                watts.append(w)
        print(mode, path.rsplit("/", 1)[-1], "samples", len(clk), "SM MHz median", statistics.median(clk),
              "W median", statistics.median(watts), "max", max(watts))
    print(mode, "us per call", us[mode])
