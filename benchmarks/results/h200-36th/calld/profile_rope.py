"""Kernel durations (torch.profiler) of the write alone and the native rotary write (f32 half tables), the
benchmark's cases (benchmarks.rope_write.Case, rotating sets), against their per-call graph times
(benchmarks.common.bench): how much of each call is the kernel itself."""
import json, sys, collections, torch
from torch.profiler import profile, ProfilerActivity
from benchmarks import common
from benchmarks.rope_write import Case, _write, _native

out = []
for fmt in ("nvfp4", "fp8"):
    for n in (4096, 16384):
        case = Case(fmt, n, common.rotations_for(Case.bytes_per_call(n)))
        for name, calls in (("write", _write(case)), ("rope f32 half", _native(case, False, "f32 half"))):
            timing = common.bench(calls)
            per_call_us = timing.us
            for _ in range(3):
                for c in calls: c()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    for c in calls: c()
                torch.cuda.synchronize()
            times = collections.defaultdict(list)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    times[e.name[:70]].append(e.device_time_total)
            kern = {k: (len(v), round(sum(v) / len(v), 2)) for k, v in times.items()}
            row = dict(fmt=fmt, tokens=n, variant=name, graph_us_per_call=round(per_call_us, 2), kernels=kern)
            print(json.dumps(row), flush=True)
            out.append(row)
json.dump(out, open(sys.argv[1], "w"), indent=1)
