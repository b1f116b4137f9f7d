"""Is the 64-token slow state (forty-fifth session) a property of a captured graph or of the time? One graph of the
bf16 write alone and one of the rotary write (f32 half tables), captured once and replayed every round, beside fresh
captures of the same calls each round."""
import sys
import time
import torch
sys.path.insert(0, ".")
from benchmarks import common, rope_write as rw

case = rw.Case("bfloat16", 64, common.rotations_for(rw.Case.bytes_per_call(64)))
make = {"write": rw._write, "f32h": lambda c: rw._native(c, False, "f32 half")}


def capture(calls):
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    calls = [calls[i % len(calls)] for i in range(max(common.MIN_GRAPH_CALLS, len(calls)))]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    return graph, len(calls)


kept = {n: capture(m(case)) for n, m in make.items()}
t0 = time.time()
for i in range(int(sys.argv[1])):
    cells = []
    for n, m in make.items():
        g, k = kept[n]
        cells.append(f"{n} kept={common._time_graph(g, k, 5, 2.0):.2f}")
        g2, k2 = capture(m(case))
        cells.append(f"fresh={common._time_graph(g2, k2, 5, 2.0):.2f}")
        del g2
    print(f"{time.time() - t0:6.2f}s round {i}: " + " ".join(cells), flush=True)
