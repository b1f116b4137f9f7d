"""Per-tile clock() marks of one consumer warp pair (block grid_tile 1, head 0: the longest block) from a
KVFUSE_PREFILL_TRACE=2 build, FP8 e4m3 and bf16 fresh 16384-token prefills; medians per interval."""
import json, math, sys, statistics, torch
from benchmarks.attention import make_cache, _step_kv, HQ, HEAD
from kvfuse.kv_cache import KVQuantMode
from kvfuse.ops.registry import AttentionCall
from kvfuse.ops import native

NEW = 16384
out = {}
for mode_name, mode in (("fp8", KVQuantMode.FP8_E4M3), ("bf16", KVQuantMode.NONE)):
    cache, bt = make_cache(mode, 1, NEW)
    q = torch.randn(NEW, HQ, HEAD, device="cuda", dtype=torch.bfloat16)
    sl = torch.full((1,), NEW, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, NEW], dtype=torch.int32, device="cuda")
    s = torch.tensor(0.5, device="cuda")
    kv = _step_kv(cache, bt, sl, NEW) if mode is KVQuantMode.NONE else (None, None)
    call = AttentionCall(q, cache, s, s, bt, sl, qsl, int(mode), 1 / math.sqrt(HEAD), None, key=kv[0], value=kv[1])
    for rep in range(3):
        o = native.prefill_attention(call)
    torch.cuda.synchronize()
    m0 = NEW - 128
    res = {}
    for c in range(2):
        words = o[m0 + 64 * c: m0 + 64 * c + 64, 0, :].contiguous().view(torch.int32).flatten().cpu().tolist()
        marks = [[w & 0xFFFFFFFF for w in words[7 * it: 7 * it + 7]] for it in range(160)]
        n = marks[0][0]
        rows = marks[1:n]
        d = lambda a, b: [(r[b] - r[a]) & 0xFFFFFFFF for r in rows]
        cyc = [((rows[i + 1][0] - rows[i][0]) & 0xFFFFFFFF) for i in range(len(rows) - 1)]
        med = {f"{a}-{b}": statistics.median(d(a, b)) for a, b in ((0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6))}
        med["6-next0"] = statistics.median([((rows[i + 1][0] - rows[i][6]) & 0xFFFFFFFF) for i in range(len(rows) - 1)])
        med["cycle"] = statistics.median(cyc)
        res[c] = dict(tiles=n, median=med, raw=rows[:20])
        print(mode_name, "consumer", c, "tiles", n, json.dumps(med), flush=True)
    # the two consumers' marks share the SM's clock: consumer 1's issue relative to consumer 0's
    out[mode_name] = res
    del cache, q, kv, call, o
    torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1], "w"), indent=1)
