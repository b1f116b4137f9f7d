"""What the decode attention kernel issues per key, by cache format, from its sm_90 SASS (no GPU).

    python -m benchmarks.sass_attention [--batch 64] [--context 4096] [--formats ...] [--dump DIR]

The Triton launcher (``kvfuse.ops.triton.attention.paged_attention``) is called on meta tensors
at the decode benchmark's reference point (``--batch`` sequences of ``--context`` cached tokens,
one query token each, 32 query / 8 KV heads, D=128, page 16, bf16 query), its launch is recorded
and compiled for sm_90 as ``benchmarks/sass_count.py`` does for the write, and the cubin is
disassembled. The kernel's time goes to its key loops: each iteration reads ``BLOCK_N`` keys and
values of one KV head. Per loop (a backward branch in the SASS), counted are the instructions per
iteration, the global loads by width, the shared-memory traffic and barriers (layout conversions),
the tensor-core instructions and the inline E2M1 converts.

The issue-rate bound, with every key in the loop that has the most iterations (the unmasked
range; the masked edge loops run at most once per program)::

    iterations = batch * kv_heads * context / BLOCK_N
    seconds   >= iterations * num_warps * instructions per iteration / (132 SMs * 4 * clock)

It is a lower bound (one warp instruction per scheduler per clock, no stall), comparable with the
measured time of the same case in ``attention.json``: a bound close to the measurement says the
kernel is issue-bound and fewer instructions per key is the lever; a bound far below says the
time goes to latency or memory.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import sys

from benchmarks.common import markdown_table, tile_fields
from benchmarks.sass_count import SCHEDULERS, SM_COUNT, compile_launch, compile_tools, disassemble

MODES = {"bfloat16": "NONE", "fp8_e4m3": "FP8_E4M3", "nvfp4": "NVFP4", "fp8_per_token_head": "FP8_PER_TOKEN_HEAD"}

_LINE = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA\s+(?:\w+\s+)?`?\(?(\.L_x_\d+)\)?")


def compile_decode(fmt: str, batch: int, context: int, q_heads: int = 32, kv_heads: int = 8, head: int = 128,
                   page: int = 16, tile_fields: dict | None = None):
    """(cubin, constexprs, options) of the decode kernel as the launcher configures it on an H100."""
    import torch

    from kvfuse.kv_cache import KVQuantMode, row_dim_for, storage_dtype
    from kvfuse.ops.registry import AttentionCall
    from kvfuse.ops.triton import attention

    mode = KVQuantMode[MODES[fmt]]
    meta = torch.device("meta")
    blocks = batch * context // page
    cache = torch.empty((blocks, 2, page, kv_heads, row_dim_for(mode, head)),
                        dtype=storage_dtype(mode, torch.bfloat16), device=meta)
    scale = torch.empty((), dtype=torch.float32, device=meta)
    call = AttentionCall(
        query=torch.empty((batch, q_heads, head), dtype=torch.bfloat16, device=meta), kv_cache=cache,
        k_scale=scale, v_scale=scale, block_table=torch.empty((batch, context // page), dtype=torch.int32, device=meta),
        seq_lens=torch.empty((batch,), dtype=torch.int32, device=meta),
        query_start_loc=torch.empty((batch + 1,), dtype=torch.int32, device=meta),
        kv_quant_mode=mode, sm_scale=head ** -0.5, sliding_window=None)
    # The launcher splits the context only when batch x KV heads leaves the H100 half empty.
    programs = batch * kv_heads
    target = attention._PROGRAMS_PER_SM * SM_COUNT
    splits = min(attention._MAX_SPLITS, -(-target // programs)) if programs < target // 2 else 1
    sink: list = []
    with compile_tools()._recording(sink):
        tiles = attention.DEFAULT_TILES.replace(**tile_fields) if tile_fields else attention.DEFAULT_TILES
        attention.paged_attention(call, num_splits=splits, tiles=tiles)
    cubin, constexprs, options = compile_launch(next(x for x in sink if x.name == "attention"))
    return cubin, constexprs, options, splits


def loops(text: str) -> list[dict]:
    """Every backward branch's body: its instruction classes, loads by width, barriers."""
    lines = text.splitlines()
    labels, instrs = {}, []
    for line in lines:
        m = _LABEL.match(line.strip())
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = _LINE.match(line)
        if m:
            instrs.append((m.group(3), m.group(4)))
    found = []
    for end, (op, rest) in enumerate(instrs):
        if not op.startswith("BRA"):
            continue
        b = _BRANCH.search(op + " " + rest)
        if not b or b.group(1) not in labels or labels[b.group(1)] > end:
            continue
        body = [o for o, _ in instrs[labels[b.group(1)]: end + 1] if o != "NOP"]
        count = collections.Counter(body)
        found.append(dict(
            instructions=len(body),
            global_loads={w: n for w, n in sorted(collections.Counter(o for o in body if o.startswith("LDG")).items())},
            shared=sum(n for o, n in count.items() if o.startswith(("LDS", "STS", "LDSM"))),
            barriers=sum(n for o, n in count.items() if o.startswith("BAR")),
            # Register spills (local memory) inside the loop: each is an L1 round trip.
            spills=sum(n for o, n in count.items() if o.startswith(("LDL", "STL"))),
            tensor_core=sum(n for o, n in count.items() if o.startswith(("HMMA", "HGMMA", "QGMMA"))),
            converts=sum(n for o, n in count.items() if o.startswith(("F2FP", "F2F", "I2F", "PRMT", "HADD2.F32"))),
            float=sum(n for o, n in count.items() if o.startswith(("FADD", "FMUL", "FFMA", "FMNMX", "MUFU", "FSEL",
                                                                   "FSETP", "HFMA2", "HMUL2", "HADD2"))),
            integer=sum(n for o, n in count.items() if o.startswith(("IMAD", "IADD3", "LEA", "SHF", "LOP3", "ISETP",
                                                                     "SEL", "IMNMX"))),
        ))
    return found



def analyse(fmt: str, batch: int, context: int, clock_ghz: float, dump_dir=None, tile_fields=None) -> dict:
    cubin, constexprs, options, splits = compile_decode(fmt, batch, context, tile_fields=tile_fields)
    text = disassemble(cubin)
    if dump_dir:
        suffix = "".join(f"_{k}{v}" for k, v in (tile_fields or {}).items())
        with open(os.path.join(dump_dir, f"attention_decode_{fmt}{suffix}.sass"), "w") as f:
            f.write(text)
    body_loops = loops(text)
    if not body_loops:
        raise RuntimeError(f"{fmt}: no loop found in the SASS")
    main = max(body_loops, key=lambda x: x["instructions"])
    num_warps = int(options.get("num_warps", 4))
    block_n = int(constexprs["BLOCK_N"])
    iterations = batch * 8 * context / block_n
    bound_us = iterations * num_warps * main["instructions"] / (SM_COUNT * SCHEDULERS * clock_ghz * 1e3)
    return dict(format=fmt, tile_fields=tile_fields or {}, batch=batch, context=context, num_warps=num_warps, block_n=block_n, splits=splits,
                loops=len(body_loops), main_loop=main, instructions_per_key=round(
                    main["instructions"] * num_warps * 32 / block_n, 1),
                issue_bound_us=round(bound_us, 1),
                constexprs={k: str(v) for k, v in constexprs.items()})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--formats", default="bfloat16,fp8_e4m3,nvfp4,fp8_per_token_head")
    parser.add_argument("--clock-ghz", type=float, default=1.98, help="SM clock under load (H100 SXM max 1.98)")
    parser.add_argument("--measured", help="attention.json of a GPU run: its decode times go beside the bound")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--dump", metavar="DIR", help="also write each kernel's SASS to DIR")
    parser.add_argument("--tile", action="append", default=[], metavar="FIELD=VALUE",
                        help="also analyse the kernels with this Tile field set (WORD_SCALES=1, MAXNREG=none, "
                             "BLOCK_N=128); repeatable, one variant each")
    args = parser.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "0"
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    measured = {}
    if args.measured:
        with open(args.measured) as f:
            data = json.load(f)
        for r in data["rows"]:
            if (r.get("op") == "decode" and r.get("impl") == "kvfuse" and r.get("batch") == args.batch
                    and r.get("context") == args.context):
                measured[r["kv_cache_dtype"]] = r["us"]
    try:
        variants = [None] + [tile_fields([spec]) for spec in args.tile]
    except ValueError as e:
        parser.error(str(e))
    rows = [analyse(fmt, args.batch, args.context, args.clock_ghz, args.dump, fields)
            for fmt in args.formats.split(",") for fields in variants]
    for r in rows:
        r["measured_us"] = measured.get(r["format"])
    meta = dict(date=datetime.date.today().isoformat(), target="sm_90", clock_ghz=args.clock_ghz,
                command="python -m benchmarks.sass_attention " + " ".join(argv or sys.argv[1:]))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sass_attention.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    headers = ["format", "tile fields", "warps x BLOCK_N", "loop SASS / iteration", "instructions / key",
               "global loads", "shared ops", "barriers", "spill ops", "tensor core", "issue bound us", "measured us"]
    table = []
    for r in rows:
        m = r["main_loop"]
        table.append([
            r["format"], ", ".join(f"{k}={v}" for k, v in r["tile_fields"].items()) or "default",
            f"{r['num_warps']} x {r['block_n']}", m["instructions"], r["instructions_per_key"],
            ", ".join(f"{k} x{v}" for k, v in m["global_loads"].items()), m["shared"], m["barriers"], m["spills"],
            m["tensor_core"], r["issue_bound_us"], "-" if r["measured_us"] is None else r["measured_us"]])
    print(markdown_table(headers, table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
