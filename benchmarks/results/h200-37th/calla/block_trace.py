"""Block-level marks from a KVFUSE_PREFILL_BLOCK_TRACE=1 build: per SM, the cycles between one block's end
and the next block's entry, each block's prologue (entry to consumer 0's first S done), loop and epilogue,
and the tail (SMs idle before the kernel's end). FP8 e4m3 and bf16 fresh prefills."""
import json, math, sys, statistics, torch
from benchmarks.attention import make_cache, _step_kv, HQ, HEAD
from kvfuse.kv_cache import KVQuantMode
from kvfuse.ops.registry import AttentionCall
from kvfuse.ops import native

out = {}
for new in (16384, 4096):
    for mode_name, mode in (("fp8", KVQuantMode.FP8_E4M3), ("bf16", KVQuantMode.NONE)):
        cache, bt = make_cache(mode, 1, new)
        q = torch.randn(new, HQ, HEAD, device="cuda", dtype=torch.bfloat16)
        sl = torch.full((1,), new, dtype=torch.int32, device="cuda")
        qsl = torch.tensor([0, new], dtype=torch.int32, device="cuda")
        s = torch.tensor(0.5, device="cuda")
        kv = _step_kv(cache, bt, sl, new) if mode is KVQuantMode.NONE else (None, None)
        call = AttentionCall(q, cache, s, s, bt, sl, qsl, int(mode), 1 / math.sqrt(HEAD), None, key=kv[0], value=kv[1])
        for rep in range(3):
            o = native.prefill_attention(call)
        torch.cuda.synchronize()
        rec = o[0::64].contiguous().view(torch.int64)[:, :, :8].cpu()  # [2 * tiles, heads, 8]
        blocks = []
        for local in range(new // 128):
            for h in range(HQ):
                r0, r1 = rec[2 * local, h].tolist(), rec[2 * local + 1, h].tolist()
                blocks.append(dict(local=local, h=h, entry=r0[0], first0=r0[1], first1=r1[1], loop_end=max(r0[2], r1[2]),
                                   end=max(r0[3], r1[3]), g0=r0[4], g1=max(r0[5], r1[5]), sm=r0[6], tiles=r0[7]))
        by_sm = {}
        for b in blocks:
            by_sm.setdefault(b["sm"], []).append(b)
        kstart = min(b["g0"] for b in blocks); kend = max(b["g1"] for b in blocks)
        long = [b for b in blocks if b["tiles"] > 16]
        ghz = statistics.median([(b["end"] - b["entry"]) / (b["g1"] - b["g0"]) for b in long])
        gaps, pro, epi, loops, per_tile, tails, heads_, busy = [], [], [], [], [], [], [], []
        for sm_id, bl in by_sm.items():
            bl.sort(key=lambda b: b["entry"])
            for a, b in zip(bl, bl[1:]):
                gaps.append(b["entry"] - a["end"])
            for b in bl:
                pro.append(b["first0"] - b["entry"]); epi.append(b["end"] - b["loop_end"])
                loops.append(b["loop_end"] - min(b["first0"], b["first1"]))
                if b["tiles"] > 1:
                    per_tile.append((b["loop_end"] - min(b["first0"], b["first1"])) / (b["tiles"] - 1))
            tails.append((kend - max(b["g1"] for b in bl)) / 1e3)
            heads_.append((min(b["g0"] for b in bl) - kstart) / 1e3)
            busy.append(sum(b["end"] - b["entry"] for b in bl) / ghz / 1e3)
        n_sm = len(by_sm)
        res = dict(case=f"{mode_name} {new}", kernel_us=(kend - kstart) / 1e3, sms=n_sm, blocks=len(blocks), ghz=round(ghz, 3),
                   blocks_per_sm=len(blocks) / n_sm,
                   gap_cycles_median=statistics.median(gaps), gap_us_per_sm=sum(gaps) / ghz / 1e3 / n_sm,
                   prologue_cycles_median=statistics.median(pro), prologue_us_per_sm=sum(pro) / ghz / 1e3 / n_sm,
                   epilogue_cycles_median=statistics.median(epi), epilogue_us_per_sm=sum(epi) / ghz / 1e3 / n_sm,
                   loop_us_per_sm=sum(loops) / ghz / 1e3 / n_sm, tile_cycles_median=statistics.median(per_tile),
                   tail_us_median=statistics.median(tails), tail_us_max=max(tails), tail_us_mean=sum(tails) / n_sm,
                   start_us_max=max(heads_), busy_us_mean=sum(busy) / n_sm)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()}), flush=True)
        out[res["case"]] = dict(summary=res, blocks=blocks[:: max(1, len(blocks) // 600)])
        del cache, q, kv, call, o
        torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1], "w"))
