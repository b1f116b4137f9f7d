"""Latency of one decode step of the demo model, compiled with kvfuse.backend and replayed as a CUDA graph.

Model: 8 layers, hidden 2048, 16 query / 8 KV heads, head size 128; batch 64, context 4096,
page 16. Caches: all bf16; FP8 e4m3 with layers 0 and 7 kept bf16 (skip layers); NVFP4 with the
same two skip layers. The compiled step (kvfuse's fused cache write + paged attention per layer)
is captured once into a ``torch.cuda.CUDAGraph`` and replayed.

    python -m benchmarks.decode_step [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import traceback

import torch


import kvfuse
from benchmarks.common import current_commit
from kvfuse.models import LlamaConfig, LlamaForCausalLM

BATCH, CONTEXT, PAGE = 64, 4096, 16
CACHES = {"bf16": dict(kv_cache_dtype="auto"),
          "fp8": dict(kv_cache_dtype="fp8", skip_layers=("0", "7")),
          "nvfp4": dict(kv_cache_dtype="nvfp4", skip_layers=("0", "7"))}


def step_inputs(device, batch: int = BATCH, context: int = CONTEXT, vocab_size: int = 1024, seed: int = 0):
    """One decode token per sequence at position ``context - 1`` over shuffled pages (seeded, so
    every rank of a tensor-parallel run gets the same pages and tokens)."""
    gen = torch.Generator().manual_seed(seed)
    pages = context // PAGE
    block_table = torch.randperm(batch * pages, generator=gen).to(torch.int32).view(batch, pages).to(device)
    pos = context - 1
    slot = block_table[:, pos // PAGE].long() * PAGE + pos % PAGE
    metadata = kvfuse.AttentionMetadata(
        slot_mapping=slot, block_table=block_table,
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        max_seq_len=context, max_query_len=1,
    )
    input_ids = torch.randint(0, vocab_size, (batch,), generator=gen).to(device)
    positions = torch.full((batch,), pos, dtype=torch.int64, device=device)
    return input_ids, positions, metadata


def time_step(cache_name, reps):
    config = LlamaConfig(num_layers=8, hidden_size=2048, num_heads=16, num_kv_heads=8, head_size=128,
                         intermediate_size=5632, vocab_size=1024)
    model = LlamaForCausalLM(config, kvfuse.KVCacheConfig(**CACHES[cache_name]), device="cuda").eval()
    caches = [kvfuse.allocate_kv_cache(spec, BATCH * CONTEXT // PAGE, PAGE, device="cuda") for spec in model.kv_specs]
    for c in caches:  # finite non-zero contents (NVFP4: scale bytes < 0x70 stay finite)
        if c.dtype == torch.uint8:
            c.random_(0, 0x70)
        else:
            c.copy_(torch.randn(c.shape, device="cuda", dtype=torch.bfloat16).to(c.dtype))
    input_ids, positions, metadata = step_inputs("cuda")
    compiled = torch.compile(model, backend=kvfuse.backend, dynamic=False)
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                compiled(input_ids, positions, caches, metadata)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            compiled(input_ids, positions, caches, metadata)
        graph.replay()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                graph.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e3 / reps)
    modes = [spec.kv_quant_mode.name for spec in model.kv_specs]
    kv_bytes = sum(c.numel() * c.element_size() for c in caches)
    del caches, graph, compiled, model
    torch.cuda.empty_cache()
    return best, modes, kv_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer replays")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    rows = []
    for name in CACHES:
        row = dict(op="decode_step", impl="kvfuse", cache=name, batch=BATCH, context=CONTEXT,
                   num_tokens=BATCH * CONTEXT)
        try:
            us, modes, kv_bytes = time_step(name, 10 if args.quick else 50)
            row.update(us=round(us, 1), layer_modes=modes, kv_cache_bytes=kv_bytes)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = next((r["us"] for r in rows if r["cache"] == "bf16" and "us" in r), None)
    for r in rows:
        if base and "us" in r:
            r["vs_bf16"] = round(r["us"] / base, 3)
    commit = current_commit()
    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(), commit=commit,
                command="python -m benchmarks.decode_step" + (" --quick" if args.quick else ""),
                model="8 layers, hidden 2048, 16/8 heads, D=128, CUDA graph of the kvfuse.backend-compiled step")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode_step.json"), "w") as f:
        json.dump(dict(device=meta["device"], date=meta["date"], commit=meta["commit"], meta=meta,
                       rows=[dict(r, kv_cache_dtype={"bf16": "bfloat16", "fp8": "fp8_e4m3"}.get(r["cache"], r["cache"]))
                             for r in rows]), f, indent=1)
    print(json.dumps(rows))


# Read (as text) by `python -m kvfuse bench`, which refuses to start this on a host without CUDA.
REQUIRES_CUDA = True


if __name__ == "__main__":
    main()
