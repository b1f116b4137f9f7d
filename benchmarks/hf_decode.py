"""Decode tokens/s of a transformers Llama-architecture model: kvfuse caches vs transformers' own paths.

Model: ``LlamaForCausalLM`` with random weights, 8 layers, hidden 2048, 16 query / 8 KV heads,
head_dim 128, intermediate 5632, vocabulary 32000, bf16; batch 64, every sequence at context
4096 (``--quick``: 2 layers, batch 8, context 512). The caches are filled with random values
instead of running a 64 x 4096 prefill (the decode cost does not depend on the values).

Rows, same model and weights, same run:

- ``kvfuse_bf16`` / ``kvfuse_fp8``: :func:`kvfuse.integrations.transformers.enable` (FP8: every
  layer e4m3), ``model.forward`` compiled with ``kvfuse.make_backend(triton.cudagraphs=True)``
  (Inductor CUDA graphs). Timed twice: ``forward`` (the compiled step with its metadata
  prepared beforehand, as an engine's scheduler would) and ``end_to_end`` (the model called as
  ``generate`` calls it, with the host-side page bookkeeping of every step);
- ``kvfuse_fp8_rotary_unfused``: the FP8 row compiled with ``fuse_rotary=False`` (each layer's
  rotation left to Inductor, its write still fused): what the rotary fusion buys in the step;
- ``hf_static_compiled``: transformers' ``StaticCache`` + ``torch.compile(mode="reduce-overhead",
  fullgraph=True)`` with SDPA, transformers' documented fastest ``generate`` path;
- ``hf_paged_sdpa``: transformers' continuous-batching paged path, where present (5.17+), run
  through ``generate_batch`` on prompts of the same shape (its tokens/s include its prefill, so
  it is reported separately, not compared).

Writes ``benchmarks/results/hf_decode.json`` and prints a table last; the goal is kvfuse FP8 >=
1.3x the best transformers bf16 row. Finishes in a few minutes on an H100.

    python -m benchmarks.hf_decode [--quick] [--steps 32] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import sys
import time
import traceback

import torch
import torch._dynamo.utils

from benchmarks.common import current_commit, markdown_table, write_json

# Read (as text) by `python -m kvfuse bench`, which refuses to start this on a host without CUDA.
REQUIRES_CUDA = True

FULL = dict(layers=8, batch=64, context=4096)
QUICK = dict(layers=2, batch=8, context=512)


def build_model(layers: int):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=16384, pad_token_id=0)
    return tf.LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()


def _time_steps(step, steps: int) -> float:
    """Seconds per call of ``step()`` (best of 3 runs of ``steps`` calls, after 3 warm-ups).

    Not :func:`benchmarks.common.bench`: a step here is a whole model call whose host-side page
    bookkeeping is part of what is measured, and the cache is sized for exactly these calls."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / steps)
    return best


def bench_kvfuse(kv_dtype: str, label: str, shape: dict, steps: int, fuse_rotary: bool = True) -> list:
    import kvfuse
    from kvfuse.integrations import transformers as kvt

    batch, context = shape["batch"], shape["context"]
    model = kvt.enable(build_model(shape["layers"]), kvfuse.KVCacheConfig(kv_cache_dtype=kv_dtype))
    total_len = context + 8 * steps + 16
    cache = kvt.KVFuseCache(model, max_seq_len=total_len, block_size=16)
    cache.prepare_step(None, batch, context - 1)  # pages for the context, filled below
    cache.end_step()
    for c in cache.kv_caches:
        if c.dtype == torch.uint8:
            c.random_(0, 0x70)
        else:
            c.copy_(torch.randn(c.shape, device="cuda", dtype=torch.bfloat16).to(c.dtype))
    be = kvfuse.make_backend(fuse_rotary=fuse_rotary, **{"triton.cudagraphs": True})
    torch._dynamo.utils.counters.clear()
    model.forward = torch.compile(model.forward, backend=be)
    ids = torch.randint(3, 32000, (batch, 1), device="cuda")
    pos = torch.full((batch, 1), context - 1, device="cuda")
    rows = []
    with torch.no_grad():
        step = cache.prepare_step(None, batch, 1)
        cache.end_step()

        def forward_only():
            # The same pages every call: the step's metadata is prepared once, outside the timing.
            model.forward(input_ids=ids, past_key_values=cache, position_ids=pos, kvfuse_step=step,
                          logits_to_keep=1)

        sec = _time_steps(forward_only, steps)
        rows.append(dict(impl=label, timing="forward", ms_per_step=round(1e3 * sec, 3),
                         tokens_per_s=round(batch / sec, 1)))

        def end_to_end():
            model(input_ids=ids, past_key_values=cache, position_ids=pos, logits_to_keep=1)

        sec = _time_steps(end_to_end, steps)
        rows.append(dict(impl=label, timing="end_to_end", ms_per_step=round(1e3 * sec, 3),
                         tokens_per_s=round(batch / sec, 1)))
    modes = sorted({r.kv_quant_mode.name if hasattr(r.kv_quant_mode, "name") else str(r.kv_quant_mode)
                    for r in be.report})
    # A graph break inside the model costs fusions and CUDA graphs: such a row measures something
    # else than kvfuse's compiled step, and says so.
    graph_breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    fused = sum(1 for x in be.report if x.fused)
    rotary = sum(1 for x in be.report if "rotary: fused" in x.reason)
    problem = None
    if graph_breaks or fused < shape["layers"]:
        problem = f"{graph_breaks} graph breaks, {fused} of {shape['layers']} layers fused"
    for r in rows:
        r.update(layer_modes=modes, fused_layers=fused, rotary_fused_layers=rotary, graph_breaks=graph_breaks)
        if problem:
            r["error"] = problem
    model = cache = None  # frees them (a del would read as undefined in the closures above)
    torch.cuda.empty_cache()
    return rows


def bench_hf_static(shape: dict, steps: int) -> list:
    from transformers import StaticCache

    batch, context = shape["batch"], shape["context"]
    model = build_model(shape["layers"])
    model.set_attn_implementation("sdpa")
    max_len = context + 8 * steps + 16
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    cache.early_initialization(batch, model.config.num_key_value_heads, model.config.head_dim, torch.bfloat16,
                               torch.device("cuda"))
    for layer in cache.layers:
        layer.keys[:, :, : context - 1].normal_()
        layer.values[:, :, : context - 1].normal_()
    takes_cache_position = "cache_position" in inspect.signature(model.forward).parameters
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(3, 32000, (batch, 1), device="cuda")
    pos = torch.full((batch, 1), context - 1, device="cuda")
    mask = torch.ones(batch, max_len, dtype=torch.long, device="cuda")

    def step():
        # Rewind to the same position every call (same work per step as a real decode).
        for layer in cache.layers:
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                layer.cumulative_length.fill_(context - 1)
        extra = {"cache_position": pos[0]} if takes_cache_position else {}
        model.forward(input_ids=ids, attention_mask=mask[:, :context], past_key_values=cache, position_ids=pos,
                      logits_to_keep=1, **extra)

    with torch.no_grad():
        sec = _time_steps(step, steps)
    model = cache = None
    torch.cuda.empty_cache()
    return [dict(impl="hf_static_compiled", timing="forward", ms_per_step=round(1e3 * sec, 3),
                 tokens_per_s=round(batch / sec, 1), layer_modes=["bf16"])]


def bench_hf_paged(shape: dict, steps: int) -> list:
    batch, context = shape["batch"], shape["context"]
    model = build_model(shape["layers"])
    if not hasattr(model, "generate_batch"):
        return [dict(impl="hf_paged_sdpa", error="transformers has no generate_batch (continuous batching)")]
    from transformers import GenerationConfig

    model.set_attn_implementation("paged|sdpa")
    prompts = [torch.randint(3, 32000, (context - 1,)).tolist() for _ in range(batch)]
    cfg = GenerationConfig(max_new_tokens=steps, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with torch.no_grad():
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate_batch(inputs=prompts, generation_config=cfg)
        torch.cuda.synchronize()
        sec = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return [dict(impl="hf_paged_sdpa", timing="generate_batch incl. prefill", ms_per_step=round(1e3 * sec / steps, 3),
                 tokens_per_s=round(batch * steps / sec, 1), layer_modes=["bf16"])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 layers, batch 8, context 512")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per timed run (default: 32)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("hf_decode: needs a CUDA device; nothing to do", file=sys.stderr)
        return 0
    shape = QUICK if args.quick else FULL
    rows = []
    runs = [("kvfuse_bf16", lambda: bench_kvfuse("auto", "kvfuse_bf16", shape, args.steps)),
            ("kvfuse_fp8", lambda: bench_kvfuse("fp8", "kvfuse_fp8", shape, args.steps)),
            ("kvfuse_fp8_rotary_unfused",
             lambda: bench_kvfuse("fp8", "kvfuse_fp8_rotary_unfused", shape, args.steps, fuse_rotary=False)),
            ("hf_static_compiled", lambda: bench_hf_static(shape, args.steps)),
            ("hf_paged_sdpa", lambda: bench_hf_paged(shape, args.steps))]
    for name, run in runs:
        try:
            new = run()
        except Exception as e:  # one failing path must not hide the others' numbers
            traceback.print_exc()
            new = [dict(impl=name, error=f"{type(e).__name__}: {str(e)[:300]}")]
        for r in new:
            r.update(batch=shape["batch"], context=shape["context"], layers=shape["layers"])
            print(json.dumps(r), flush=True)
        rows += new
    hf_best = max((r["tokens_per_s"] for r in rows if r.get("impl") == "hf_static_compiled" and "tokens_per_s" in r),
                  default=None)
    for r in rows:
        if hf_best and "tokens_per_s" in r:
            r["vs_hf_static"] = round(r["tokens_per_s"] / hf_best, 3)
    import transformers

    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(), commit=current_commit(),
                torch=torch.__version__, transformers=transformers.__version__,
                command="python -m benchmarks.hf_decode" + (" --quick" if args.quick else ""),
                model=f"LlamaForCausalLM {shape['layers']} layers, hidden 2048, 16/8 heads, D=128, bf16")
    write_json(os.path.join(args.out, "hf_decode_quick.json" if args.quick else "hf_decode.json"),
               dict(meta=meta, rows=rows))
    print(markdown_table(("impl", "timing", "ms/step", "tokens/s", "vs hf static", "error"),
                         [(r["impl"], r.get("timing", "-"), r.get("ms_per_step", "-"), r.get("tokens_per_s", "-"),
                           r.get("vs_hf_static", "-"), r.get("error", "")) for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
