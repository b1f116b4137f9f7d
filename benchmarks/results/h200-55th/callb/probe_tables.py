"""Does where the cos/sin tables sit change the 64-token rotary write's time? Same values, same
kernel, tables at different addresses. python probe_tables.py OUT.json"""
import json, sys, torch
from benchmarks import common, rope_write as rw
out = {}
torch.manual_seed(0)
for fmt in ("bfloat16", "fp8"):
    T = 64
    case = rw.Case(fmt, T, common.rotations_for(rw.Case.bytes_per_call(T)))
    base = dict(case.tables)
    big = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # its own segment (large pool)
    def placed(kind, where):
        cos, sin = base[kind]
        if where == "default":
            return cos, sin
        if where == "clone":
            return cos.clone(), sin.clone()
        off = {"big0": 0, "big4k": 4096, "big1m": 1 << 20, "big3m": 3 << 20, "big33m": 33 << 20}[where]
        nb = cos.numel() * cos.element_size()
        c = big[off:off + nb].view(cos.dtype).view(cos.shape); c.copy_(cos)
        s = big[off + nb + 4096: off + 2 * nb + 4096].view(sin.dtype).view(sin.shape); s.copy_(sin)
        return c, s
    rows = []
    for rnd in range(3):
        row = {"write": round(common.bench(rw._write(case), trials=5).us, 3)}
        for kind in ("bf16", "bf16 half", "f32 half"):
            for where in ("default", "clone", "big0", "big4k", "big1m", "big3m", "big33m"):
                case.tables[kind] = placed(kind, where)
                row[f"{kind} @{where}"] = round(common.bench(rw._native(case, False, kind), trials=5).us, 3)
                case.tables[kind] = base[kind]
        rows.append(row)
        print(fmt, rnd, row, flush=True)
    out[fmt] = rows
json.dump(out, open(sys.argv[1], "w"), indent=1)
