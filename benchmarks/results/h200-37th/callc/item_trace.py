"""Per-item marks (clock64, per SM) of a KVFUSE_PREFILL_BLOCK_TRACE=1 build of the work-item kernel: item read,
query ready, first S done, loop end (product added), stores done; per consumer. Fresh 16384 / 4096, FP8 and bf16."""
import json, math, sys, statistics, torch
from benchmarks.attention import make_cache, _step_kv, HQ, HEAD
from kvfuse.kv_cache import KVQuantMode
from kvfuse.ops.registry import AttentionCall
from kvfuse.ops import native

label = sys.argv[2]
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
            st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            st.record(); o = native.prefill_attention(call); en.record()
        torch.cuda.synchronize()
        kernel_us = st.elapsed_time(en) * 1e3
        rec = o[0::64].contiguous().view(torch.int64)[:, :, :8].cpu()
        res = {"case": f"{mode_name} {new}", "label": label, "event_us": round(kernel_us, 1)}
        for c in range(2):
            items = []
            for local in range(new // 128):
                for h in range(HQ):
                    r = rec[2 * local + c, h].tolist()
                    items.append(dict(t_item=r[0], t_q=r[1], t_first=r[2], t_loop=r[3], t_end=r[4], sm=r[5], tiles=r[6], n=r[7]))
            by_sm = {}
            for it in items:
                by_sm.setdefault(it["sm"], []).append(it)
            gaps, span = [], []
            for bl in by_sm.values():
                bl.sort(key=lambda x: x["t_item"])
                gaps += [b["t_item"] - a["t_end"] for a, b in zip(bl, bl[1:])]
                span.append(bl[-1]["t_end"] - bl[0]["t_item"])
            tot = lambda f: sum(f(x) for x in items) / len(by_sm)
            sp = sum(span) / len(span)
            part = dict(item_to_q=tot(lambda x: x["t_q"] - x["t_item"]), q_to_first=tot(lambda x: x["t_first"] - x["t_q"]),
                        loop=tot(lambda x: x["t_loop"] - x["t_first"]), epilogue=tot(lambda x: x["t_end"] - x["t_loop"]),
                        gaps=sum(gaps) / len(by_sm))
            res[f"c{c}"] = dict(sms=len(by_sm), span_cycles=round(sp), ghz=round(sp / kernel_us / 1e3, 3),
                                frac={k: round(v / sp, 4) for k, v in part.items()},
                                med=dict(item_to_q=statistics.median([x["t_q"] - x["t_item"] for x in items]),
                                         q_to_first=statistics.median([x["t_first"] - x["t_q"] for x in items]),
                                         epilogue=statistics.median([x["t_end"] - x["t_loop"] for x in items]),
                                         gap=statistics.median(gaps) if gaps else None,
                                         tile=statistics.median([(x["t_loop"] - x["t_first"]) / (x["tiles"] - 1) for x in items if x["tiles"] > 1])))
        print(json.dumps(res), flush=True)
        out[res["case"]] = res
        del cache, q, kv, call, o
        torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1], "w"), indent=1)
