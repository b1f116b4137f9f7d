"""Does where the buffers sit decide the small rotary write's ratio to the write alone? One factor
at a time: each of the buffers the two calls read or write (the projection output holding K and V,
the write alone's rotated K, the cache, the slots, the tables, the scales) moved to 8 random
offsets in an arena, the others at their base offsets; plus 8 controls at the base offsets.
Interleaved timing (10 rounds) of the write alone and the native rotary write over bf16 half
tables. python probe_place.py OUT.json"""
import json, random, sys, torch
from benchmarks import common, rope_write as rw
from kvfuse.ops import native, reference

ARENA = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
PARTS = ("src", "rot", "cache", "slots", "tables", "scales")
SPAN = {p: (i * 80 << 20) for i, p in enumerate(PARTS)}  # each part its own 80 MB of the arena


def place(t, off):
    t = t.contiguous()
    nb = t.numel() * t.element_size()
    v = ARENA[off:off + nb].view(t.dtype).view(t.shape)
    v.copy_(t)
    return v


def calls(case, offs):
    """(write calls, rotary calls) with every buffer at offs[part] (bytes into its span)."""
    per_set = lambda t: (t.numel() * t.element_size() + 4095) // 4096 * 4096
    sets, rots, slots = [], [], []
    at = {p: SPAN[p] + offs[p] for p in PARTS}
    for i, (q, k, v) in enumerate(case.sets):
        out = k._base
        o = place(out, at["src"]); at["src"] += per_set(out)
        n = out.shape[0]
        q2, k2, v2 = o.split([rw.HQ * rw.D, rw.HKV * rw.D, rw.HKV * rw.D], dim=-1)
        sets.append((q2.view(n, rw.HQ, rw.D), k2.view(n, rw.HKV, rw.D), v2.view(n, rw.HKV, rw.D)))
        r = reference.apply_rope(k, case.cos, case.sin, None, rw.D, True)
        rots.append(place(r, at["rot"])); at["rot"] += per_set(r)
        slots.append(place(case.slots[i], at["slots"])); at["slots"] += per_set(case.slots[i])
    cache = place(case.cache, at["cache"])
    cos, sin = case.tables["bf16 half"]
    cos2 = place(cos, at["tables"]); sin2 = place(sin, at["tables"] + per_set(cos))
    ks = place(case.k_scale.reshape(()), at["scales"]); vs = place(case.v_scale.reshape(()), at["scales"] + 256)
    write = [lambda i=i: torch.ops.kvfuse.encode_and_cache_write(
        rots[i], sets[i][2], cache, slots[i], ks, vs, case.mode, "l") for i in range(len(sets))]
    rope = [lambda i=i: native.rope_encode_and_cache_write(
        None, sets[i][1], sets[i][2], cache, slots[i], ks, vs, cos2, sin2, None, rw.D, True, case.mode, force=True)
        for i in range(len(sets))]
    return write, rope


def main():
    rng = random.Random(56)
    out = []
    for T in (32, 64):
        case = rw.Case("fp8", T, common.rotations_for(rw.Case.bytes_per_call(T)))
        base = {p: 0 for p in PARTS}
        plan = [("control", dict(base)) for _ in range(8)]
        for part in PARTS:
            for _ in range(8):
                offs = dict(base)
                offs[part] = rng.randrange(0, (64 << 20) // 256) * 256
                plan.append((part, offs))
        rng.shuffle(plan)
        for part, offs in plan:
            write, rope = calls(case, offs)
            timed = common.bench_interleaved({"write": write, "rope": rope}, rounds=10, min_ms=1.0)
            mid, lo, hi = timed.ratio("rope", "write")
            row = {"tokens": T, "moved": part, "offsets": offs, "write": round(timed.median("write"), 3),
                   "rope": round(timed.median("rope"), 3), "ratio": round(mid, 3), "range": [round(lo, 3), round(hi, 3)]}
            out.append(row)
            print(T, part, offs[part] if part != "control" else "", row["write"], row["rope"], row["ratio"], flush=True)
        json.dump(out, open(sys.argv[1], "w"), indent=1)


main()
