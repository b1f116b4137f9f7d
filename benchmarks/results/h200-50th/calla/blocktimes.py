"""Per-block %globaltimer records (KVFUSE_PROBE_BLOCK_TIMES build) of the native write and rotary
writes, timed as the benchmark times them (a CUDA graph of >= 8 calls over rotating buffer sets).

usage: blocktimes.py OUTDIR FMT:TOKENS ...     prints one summary line per (case, variant)."""
import json
import os
import sys

import numpy as np
import torch

from benchmarks import common
from benchmarks import rope_write as rw
import kvfuse.ops.native as native

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
built = native._ensure_built()
assert built["cuda"], built
probe = torch.ops.kvfuse_native
VARIANTS = {
    "write": lambda c: rw._write(c),
    "full": lambda c: rw._native(c, False, "bf16"),
    "bf16half": lambda c: rw._native(c, False, "bf16 half"),
    "f32half": lambda c: rw._native(c, False, "f32 half"),
}


def graph_of(calls):
    calls = [calls[i % len(calls)] for i in range(max(common.MIN_GRAPH_CALLS, len(calls)))]
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in calls:
            fn()
    return g, len(calls)


def analyse(rec, launches_expected):
    entry, go, end, meta = (rec[:, i].astype(np.int64) for i in range(4))
    sm = (meta >> 48) & 0xFFFF
    grid = (meta >> 24) & 0xFFFFFF
    g = int(grid[0])
    n = len(rec) // g
    res = {"grid": g, "launches": n, "expected": launches_expected, "records": len(rec)}
    if len(rec) % g or n < 3:
        res["error"] = "records not whole launches"
        return res
    L = lambda a: a[: n * g].reshape(n, g)
    entry, go, end, sm = L(entry), L(go), L(end), L(sm)
    first_entry, first_go, last_end = entry.min(1), go.min(1), end.max(1)
    # launch 0 follows the graph start: drop it from the gaps
    gaps = first_go[1:] - last_end[:-1]
    entry_gaps = first_entry[1:] - last_end[:-1]
    span = last_end - first_go
    dur = end - go
    ends_sorted = np.sort(end - first_go[:, None], axis=1)
    # per launch: the end at which 90% / 99% of blocks are done, and the last
    q = lambda f: float(np.median(ends_sorted[:, int(f * (g - 1))]))
    sm_last = np.array([[np.max(end[k][sm[k] == s]) for s in np.unique(sm[k])] for k in range(n)])
    sm_last_rel = sm_last - first_go[:, None]
    per_sm = np.array([np.bincount(sm[k], minlength=int(sm.max()) + 1) for k in range(n)])
    uniq = np.unique(end.ravel())
    res.update({
        "period_ns": float(np.median(np.diff(last_end))),
        "span_go_ns": float(np.median(span)),
        "gap_end_to_next_go_ns": float(np.median(gaps)),
        "gap_end_to_next_entry_ns": float(np.median(entry_gaps)),
        "go_minus_entry_first_ns": float(np.median(first_go - first_entry)),
        "block_dur_median_ns": float(np.median(dur)),
        "block_dur_p10_ns": float(np.percentile(dur, 10)),
        "block_dur_p90_ns": float(np.percentile(dur, 90)),
        "end_q50_ns": q(0.5), "end_q90_ns": q(0.9), "end_q99_ns": q(0.99),
        "sm_last_median_ns": float(np.median(sm_last_rel)),
        "sm_last_min_ns": float(np.median(sm_last_rel.min(1))),
        "blocks_per_sm": [int(per_sm.min()), int(per_sm.max())],
        "sms": int(len(np.unique(sm[0]))),
        "timer_step_ns": int(np.min(np.diff(uniq))) if len(uniq) > 1 else -1,
        "go_spread_first_wave_ns": float(np.median(np.sort(go - first_go[:, None], axis=1)[:, min(g, 132 * 9) - 1])),
    })
    return res


results = []
for spec in sys.argv[2:]:
    fmt, tokens = spec.split(":")
    tokens = int(tokens)
    case = rw.Case(fmt, tokens, common.rotations_for(rw.Case.bytes_per_call(tokens)))
    for name, make in VARIANTS.items():
        calls = make(case)
        us = common.bench(calls, trials=15).us
        g, per_replay = graph_of(calls)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        probe.probe_reset()
        reps = 4
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
        rec = probe.probe_read().numpy()
        np.save(os.path.join(out, f"{fmt}_{tokens}_{name}.npy"), rec)
        r = analyse(rec, reps * per_replay)
        r.update({"fmt": fmt, "tokens": tokens, "variant": name, "bench_us": round(us, 3)})
        results.append(r)
        print(json.dumps(r), flush=True)
        del g
json.dump(results, open(os.path.join(out, "blocktimes.json"), "w"), indent=1)
cols = ["bench_us", "period_ns", "span_go_ns", "gap_end_to_next_go_ns", "go_minus_entry_first_ns",
        "block_dur_median_ns", "end_q50_ns", "end_q90_ns", "end_q99_ns", "sm_last_min_ns", "sm_last_median_ns"]
print("case variant grid " + " ".join(cols))
for r in results:
    print(f"{r['fmt']}:{r['tokens']} {r['variant']} {r['grid']} " + " ".join(str(round(r.get(c, -1))) if c != 'bench_us' else str(r[c]) for c in cols))
