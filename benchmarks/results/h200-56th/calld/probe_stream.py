"""Is the small rotary write's two-level ratio decided by the stream its graph's warm-up ran on?
FP8, 32 and 64 tokens, the write alone and the native rotary write over bf16 half tables, each
captured after a warm-up on a chosen stream, then timed in turn (8 rounds). Phases: the benchmark's
own capture (a new pool stream per capture) 40 times; both warm-ups on pool stream k, k = 0..31
(streams made up front); the write's on stream 0 and the rotary write's on stream k; both on the
current stream (no side stream), 10 times. python probe_stream.py OUT.json"""
import json, statistics, sys, torch
from benchmarks import common, rope_write as rw


def capture(calls, warm):
    calls = [calls[i % len(calls)] for i in range(max(common.MIN_GRAPH_CALLS, len(calls)))]
    if warm is not None:
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):
            for fn in calls:
                fn()
        torch.cuda.current_stream().wait_stream(warm)
    else:
        for fn in calls:
            fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in calls:
            fn()
    return g, len(calls)


def pair(write, rope, ws, rs, rounds=8):
    gw, nw = capture(write, ws)
    gr, nr = capture(rope, rs)
    repw, repr_ = common._replays_for(gw, 0.5), common._replays_for(gr, 0.5)
    sw, sr = [], []
    for r in range(rounds):
        order = ("w", "r") if r % 2 == 0 else ("r", "w")
        for o in order:
            if o == "w":
                sw.append(common._graph_sample(gw, repw, nw))
            else:
                sr.append(common._graph_sample(gr, repr_, nr))
    ratios = [a / b for a, b in zip(sr, sw)]
    return round(statistics.median(sw), 3), round(statistics.median(sr), 3), round(statistics.median(ratios), 3)


def main():
    out = []
    for T in (32, 64):
        case = rw.Case("fp8", T, common.rotations_for(rw.Case.bytes_per_call(T)))
        write, rope = rw._write(case), rw._native(case, False, "bf16 half")
        for fn in write + rope:
            fn()
        torch.cuda.synchronize()
        def rec(phase, k, res):
            out.append({"tokens": T, "phase": phase, "k": k, "write": res[0], "rope": res[1], "ratio": res[2]})
            print(T, phase, k, *res, flush=True)
        for i in range(40):
            t = common.bench_interleaved({"write": write, "rope": rope}, rounds=8, min_ms=0.5)
            rec("bench", i, (round(t.median("write"), 3), round(t.median("rope"), 3), round(t.ratio("rope", "write")[0], 3)))
        pool = [torch.cuda.Stream() for _ in range(32)]
        for k in range(32):
            rec("both on k", k, pair(write, rope, pool[k], pool[k]))
        for k in range(32):
            rec("write 0, rope k", k, pair(write, rope, pool[0], pool[k]))
        for i in range(10):
            rec("current", i, pair(write, rope, None, None))
        json.dump(out, open(sys.argv[1], "w"), indent=1)


main()
