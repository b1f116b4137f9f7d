"""Decode-step latency of the demo model at tensor-parallel size 1 vs 2, compiled and CUDA-graphed.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m benchmarks.tp_decode_step [--quick] [--out DIR]

Model (as benchmarks/decode_step.py): 8 layers, hidden 2048, 16 query / 8 KV heads, head size
128, MLP 5632, bf16 weights; batch 64, context 4096, page 16. Caches: all bf16; FP8 e4m3 with
layers 0 and 7 kept bf16. Each step is compiled with ``kvfuse.backend`` (``dynamic=False``) and
captured into one ``torch.cuda.CUDAGraph`` (at TP=2 the graph holds the NCCL all-reduces).

TP=1: every rank runs the whole model on its own GPU at the same time (no communication), so
no GPU idles; rank 0's number is the result. TP=2: the model split over both GPUs (each rank
8 of the 16 query heads, their 4 KV heads and so half the cache, half the MLP), all-reduce
after the attention output and after the MLP down projection. Replays are timed with CUDA events; a rank's number is the
median over trials of the mean replay time, and the TP=2 result is the slower rank's. Every
rank replays the same number of times (a graph with collectives must be replayed in lockstep).

Writes ``tp_decode_step.json`` and ``tp_decode_step.md`` into ``--out`` (default
``benchmarks/results``) on rank 0 and prints a short table last. NVLink multicast (NVLS) is
turned off unless ``NCCL_NVLS_ENABLE`` is already set.

``--cpu-smoke`` runs the same flow on CPU (gloo, a tiny model and context, no CUDA graph, wall
clock timing) to check the script itself; its numbers mean nothing and it writes nothing.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before NCCL initializes

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import kvfuse  # noqa: E402
from benchmarks.common import device_info, markdown_table, write_json, write_markdown  # noqa: E402
from benchmarks.decode_step import step_inputs  # noqa: E402
from kvfuse.distributed import init_tensor_parallel, shutdown_tensor_parallel  # noqa: E402
from kvfuse.models import LlamaConfig, LlamaForCausalLM  # noqa: E402

BATCH, CONTEXT, PAGE = 64, 4096, 16
MODEL = dict(num_layers=8, hidden_size=2048, num_heads=16, num_kv_heads=8, head_size=128, intermediate_size=5632,
             vocab_size=1024)
SMOKE_MODEL = dict(num_layers=8, hidden_size=64, num_heads=4, num_kv_heads=2, head_size=16, intermediate_size=64,
                   vocab_size=64)
CACHES = {"bf16": dict(kv_cache_dtype="auto"), "fp8": dict(kv_cache_dtype="fp8", skip_layers=("0", "7"))}


def _agree(flag: bool, group, device: str) -> bool:
    """True only if ``flag`` holds on every rank of ``group`` (so all ranks take the same path)."""
    t = torch.tensor([1 if flag else 0], device=device)
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_step(cache_name: str, tp_group, reps: int, trials: int, device: str, sizes: dict) -> dict:
    """Compile, capture and time one decode step; ``tp_group`` None = the whole model on this device."""
    config = LlamaConfig(**sizes["model"])
    kv_config = kvfuse.KVCacheConfig(**CACHES[cache_name])
    model = LlamaForCausalLM(config, kv_config, device=device, tp_group=tp_group).eval()
    gen = torch.Generator(device=device).manual_seed(1 + model.tensor_parallel.rank)
    num_blocks = sizes["batch"] * sizes["context"] // PAGE
    caches = [kvfuse.allocate_kv_cache(spec, num_blocks, PAGE, device=device) for spec in model.kv_specs]
    for c in caches:  # finite, non-zero contents
        c.copy_(torch.randn(c.shape, device=device, dtype=torch.bfloat16, generator=gen).to(c.dtype))
    input_ids, positions, metadata = step_inputs(device, sizes["batch"], sizes["context"],
                                                 sizes["model"]["vocab_size"])
    compiled = torch.compile(model, backend=kvfuse.backend, dynamic=False)
    step = functools.partial(compiled, input_ids, positions, caches, metadata)
    start = time.perf_counter()
    graph, error = None, None
    with torch.no_grad():
        if device == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):  # compiles, and initializes NCCL before any capture
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
        else:
            for _ in range(3):
                step()
        compile_s = time.perf_counter() - start
        if device == "cuda":
            try:
                graph = torch.cuda.CUDAGraph()
                # thread_local: the NCCL watchdog thread may query events while this thread captures.
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    step()
            except Exception as e:  # noqa: BLE001 - timed without a graph, and the row says so
                graph, error = None, f"{type(e).__name__}: {str(e)[:200]}"
                torch.cuda.synchronize()
        graphed = _agree(graph is not None, tp_group, device)
        run = graph.replay if graphed else step
        for _ in range(3):
            run()
        _sync(device)
        if tp_group is not None:
            dist.barrier(group=tp_group)
        samples = []
        for _ in range(trials):
            if device == "cuda":
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(reps):
                    run()
                end.record()
                end.synchronize()
                samples.append(begin.elapsed_time(end) * 1e3 / reps)
            else:
                t0 = time.perf_counter()
                for _ in range(reps):
                    run()
                samples.append((time.perf_counter() - t0) * 1e6 / reps)
    row = dict(us=statistics.median(samples), graphed=graphed, compile_s=round(compile_s, 1),
               layer_modes=[s.kv_quant_mode.name for s in model.kv_specs],
               kv_heads_per_rank=model.kv_specs[0].num_kv_heads,
               kv_cache_bytes_per_rank=sum(c.numel() * c.element_size() for c in caches))
    if error:
        row["capture_error"] = error
    del run, step, graph, compiled, caches, model  # the next configuration needs the memory
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer replays")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--cpu-smoke", action="store_true", help="check the script on CPU (tiny sizes, no output)")
    args = parser.parse_args()
    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("tp_decode_step: needs CUDA GPUs (launch: torchrun --nproc-per-node 2 -m benchmarks.tp_decode_step)")
        return 2
    if "RANK" not in os.environ:
        print("tp_decode_step: launch with torchrun --nproc-per-node 2 -m benchmarks.tp_decode_step")
        return 2
    tp = init_tensor_parallel(device=device)
    if tp.tp_size != 2:
        print(f"tp_decode_step: launch with 2 processes (torchrun --nproc-per-node 2), got {tp.tp_size}")
        shutdown_tensor_parallel()
        return 2
    sizes = (dict(model=SMOKE_MODEL, batch=4, context=64) if args.cpu_smoke
             else dict(model=MODEL, batch=BATCH, context=CONTEXT))
    reps, trials = (2, 2) if args.cpu_smoke else (10, 3) if args.quick else (30, 7)
    world = dist.group.WORLD
    rows = []
    try:
        for cache in CACHES:
            for tp_size, group in ((1, None), (2, world)):
                row = dict(op="decode_step", impl="kvfuse", cache=cache, tp_size=tp_size, batch=sizes["batch"],
                           context=sizes["context"])
                try:
                    row.update(time_step(cache, group, reps, trials, device, sizes))
                except Exception as e:  # noqa: BLE001 - one failed config must not hide the others
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                per_rank = [None] * tp.tp_size
                dist.all_gather_object(per_rank, row.get("us"))
                row["us_per_rank"] = [round(u, 1) if u is not None else None for u in per_rank]
                if "us" in row:
                    # TP=2: the step ends when the slower rank ends. TP=1: rank 0's own model.
                    row["us"] = round(max(u for u in per_rank if u is not None) if tp_size == 2 else row["us"], 1)
                rows.append(row)
                if tp.rank == 0:
                    print({k: v for k, v in row.items() if k != "layer_modes"}, flush=True)
                dist.barrier()
    finally:
        if tp.rank == 0:
            _report(rows, args, write=not args.cpu_smoke)
        shutdown_tensor_parallel()
    return 1 if any("error" in r for r in rows) else 0


def _report(rows: list, args, write: bool) -> None:
    for row in rows:
        base = next((r for r in rows if r["cache"] == row["cache"] and r["tp_size"] == 1 and "us" in r), None)
        if base and "us" in row:
            row["speedup_vs_tp1"] = round(base["us"] / row["us"], 3)
    command = "torchrun --nproc-per-node 2 -m benchmarks.tp_decode_step" + (" --quick" if args.quick else "")
    info = device_info(command)
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError):
        nccl = "unknown"
    info.update(nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"), nccl=nccl, model=MODEL, batch=BATCH,
                context=CONTEXT, page=PAGE, caches=CACHES)
    if write:
        write_json(os.path.join(args.out, "tp_decode_step.json"), dict(info, rows=rows))
    table_rows = [(r["cache"], r["tp_size"], r.get("us", "error"), r.get("speedup_vs_tp1", "-"),
                   "/".join(str(u) for u in r.get("us_per_rank", [])), "yes" if r.get("graphed") else "no",
                   r.get("kv_heads_per_rank", "-"), round(r.get("kv_cache_bytes_per_rank", 0) / 2**30, 2))
                  for r in rows]
    headers = ("cache", "TP", "step us", "speedup", "us per rank", "CUDA graph", "KV heads/rank", "KV GiB/rank")
    if write:
        write_markdown(os.path.join(args.out, "tp_decode_step.md"), "Decode step, TP=1 vs TP=2", info,
                       markdown_table(headers, table_rows),
                       notes=["TP=1: each GPU runs the whole model alone (rank 0's time reported); TP=2: the slower "
                              "rank's time", "NCCL with NVLink multicast off (NCCL_NVLS_ENABLE=0)"])
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *table_rows)]
    print()
    batch, context = (rows[0]["batch"], rows[0]["context"]) if rows else (BATCH, CONTEXT)
    print(f"decode step, batch {batch}, context {context}, {info['device']} x2 (NVLS off):")
    for line in (headers, *table_rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip())


if __name__ == "__main__":
    sys.exit(main())
