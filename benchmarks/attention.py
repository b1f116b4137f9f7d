"""Paged attention on the GPU: kvfuse (Triton), kvfuse's FlashInfer backend, FlashInfer, torch SDPA.

Decode: batch 1/16/64/256 x context 1k/4k/16k, 32 query / 8 KV heads, head size 128, page 16,
caches bf16 / FP8 e4m3 / NVFP4 / per-token-head FP8; mixed formats (K and V sides in different modes:
FP8 K + NVFP4 V, bf16 K + FP8 V) at batch 64 x context 4096 only. Prefill: one sequence of 4k / 16k tokens
(causal). Append (issue 16): chunked prefill (batch 8, 512 new tokens on a 4096-token prefix) and
4-token speculative decode (batch 64, context 4096), kvfuse against FlashInfer's paged prefill.
Reports microseconds, GB/s of KV bytes read and the fraction of the device-to-device copy
bandwidth measured in the same run (copy bandwidth = (read + write bytes) / time).

Every timing flushes L2 before each call and subtracts the flush's own time, so small caches
are not served from L2. Calls are captured in a CUDA graph where the implementation allows it
(kvfuse's FlashInfer backend refuses capture by design; it is timed with back-to-back launches).

    python -m benchmarks.attention [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import dataclasses
import traceback

import torch

from benchmarks.common import bench_cold_l2 as bench_us
from benchmarks.common import current_commit, tile_fields
from kvfuse.kv_cache import KVFormat, KVQuantMode, mixed_page_layout, row_dim_for, storage_dtype
from kvfuse.ops.registry import AttentionCall

# Launch tiles of kvfuse's Triton kernel for this run: the defaults, or what --tune found.
TILES = None
# --sweep-new-tokens: time NEW_TOKEN_SWEEP's tiles at bf16 prefill (and the FP8 / prefix-partial sweeps).
SWEEP_NEW_TOKENS = False
# --rounds: prefill and append cases time every implementation this many times, round-robin, and
# report the median (a long run of compute-bound kernels lowers the clock for whatever runs next).
ROUNDS = 1

HQ, HKV, HEAD, PAGE = 32, 8, 128, 16
MODES = {"bf16": KVQuantMode.NONE, "fp8": KVQuantMode.FP8_E4M3, "nvfp4": KVQuantMode.NVFP4,
         "fp8_pth": KVQuantMode.FP8_PER_TOKEN_HEAD}
#: Mixed formats timed at decode (kvfuse only: no other implementation reads such pages): name ->
#: (K side's mode, V side's mode), each at MIXED_DECODE_CASES' (batch, context).
MIXED_MODES = {"fp8/nvfp4": (KVQuantMode.FP8_E4M3, KVQuantMode.NVFP4),
               "bf16/fp8": (KVQuantMode.NONE, KVQuantMode.FP8_E4M3)}
MIXED_DECODE_CASES = ((64, 4096),)
ANCHORS = {("decode", "bf16", 64, 4096): ("flashinfer", 375.0, 0.95),
           ("decode", "fp8", 64, 4096): ("flashinfer_tc", 258.0, 0.69)}

def _kvfuse(args, key=None, value=None, **options):
    """kvfuse's Triton attention on ``args`` (the op's argument tuple), with this run's tiles;
    ``key`` / ``value``: the step's K/V, as a layer with a bf16 cache passes them."""
    from kvfuse.ops.triton import attention as ta

    call = AttentionCall(*args, key=key, value=value)
    tiles = TILES or ta.DEFAULT_TILES
    return lambda: ta.paged_attention(call, tiles=tiles, **options)


def _step_kv(cache, block_table, seq_lens, new):
    """The K/V rows a step wrote for its ``new`` newest tokens per sequence (what a layer passes to
    kvfuse's attention as ``key`` / ``value``), gathered from a bf16 cache."""
    batch = block_table.shape[0]
    pos = seq_lens.long()[:, None] - new + torch.arange(new, device=cache.device)[None, :]
    blocks = block_table.long().gather(1, pos // PAGE)
    key = cache[blocks, 0, pos % PAGE].reshape(batch * new, HKV, HEAD).contiguous()
    value = cache[blocks, 1, pos % PAGE].reshape(batch * new, HKV, HEAD).contiguous()
    return key, value


def _kvfuse_rows(args, impls, new, sweep=False, cached_prefix=False):
    """kvfuse's timed functions for a call with ``new`` tokens per sequence: {impl: (fn, graph)}.

    A layer with a bf16 cache hands attention its step's K/V (``kvfuse``, the new-token kernel);
    ``kvfuse_pages`` is the same call without them; for prefill-sized calls ``kvfuse_paged_prefix``
    reads the prefix from the pages instead of gathering it first. A quantized cache's prefill
    gathers the whole context (``kvfuse``) or, for prefill-sized calls, only its new rows with the
    prefix through the paged kernel (``kvfuse_partials``). ``sweep`` adds NEW_TOKEN_SWEEP's tiles
    (FP8: NEW_TOKEN_SWEEP_FP8's) and, for a quantized cache with a ``cached_prefix``,
    PREFIX_TILE_SWEEP's."""
    fns = {}
    mode = KVQuantMode(args[7])
    if "kvfuse_native" in impls and new > 4:
        fns.update(_native_prefill_rows(args, mode, new))
    if "kvfuse" not in impls:
        return fns
    if mode is not KVQuantMode.NONE:
        # The quantized prefill path (rows gathered from the pages; FP8 dots for e4m3), its
        # decoded-rows variant for e4m3, and the paged kernel it replaced.
        fns.update({"kvfuse": (_kvfuse(args), True), "kvfuse_pages": (_kvfuse(args, new_token_kernel=False), True)})
        if new > 4:
            fns["kvfuse_partials"] = (_kvfuse(args, whole_context=False), True)
        if mode is KVQuantMode.FP8_E4M3:
            fns["kvfuse_decoded"] = (_kvfuse(args, fp8_dots=False), True)
            if sweep:
                fns.update(_new_token_variants(args, None, None, tile_key="small_fp8", sweep=NEW_TOKEN_SWEEP_FP8))
        if sweep and cached_prefix and new > 4:
            fns.update(_prefix_tile_variants(args))
        return fns
    key, value = _step_kv(args[1], args[4], args[5], new)
    fns.update({"kvfuse": (_kvfuse(args, key=key, value=value), True), "kvfuse_pages": (_kvfuse(args), True)})
    if new > 4:
        fns["kvfuse_paged_prefix"] = (_kvfuse(args, key=key, value=value, whole_context=False), True)
    if sweep:
        fns.update(_new_token_variants(args, key, value))
    return fns


def _native_prefill_rows(args, mode, new):
    """The native prefill kernel (csrc/cuda/prefill_attention.cu) where it takes the call:
    ``kvfuse_native`` (a bf16 cache's call with the step's K/V; an FP8 / NVFP4 cache's call
    without), launched in its default grid order, and ``kvfuse_native_tiles`` with the ``tiles``
    order (each head's query tiles together)."""
    from kvfuse.ops import native

    if mode is KVQuantMode.NONE:
        key, value = _step_kv(args[1], args[4], args[5], new)
        call = AttentionCall(*args, key=key, value=value)
    else:
        call = AttentionCall(*args)
    reason = native.prefill_refusal(call)
    if reason is not None:
        print(f"kvfuse_native: {reason}", flush=True)
        return {}
    return {"kvfuse_native": (lambda: native.prefill_attention(call), True),
            "kvfuse_native_tiles": (lambda: native.prefill_attention(call, grid_order="tiles"), True)}


#: New-token prefill tiles timed by --sweep-new-tokens: (BLOCK_M, BLOCK_N, num_warps, num_stages,
#: other Tile fields).
NEW_TOKEN_SWEEP = ((64, 64, 4, 3, {"TMA": True, "Q_REGISTERS": True, "GRID_ORDER": "tiles"}),
                   (64, 64, 4, 3, {"TMA": True, "Q_REGISTERS": True, "GRID_ORDER": "heads"}),
                   (64, 64, 4, 3, {"TMA": True, "Q_REGISTERS": True, "GRID_ORDER": "group"}))
#: The same for FP8 dots (an FP8 e4m3 cache's prefill): byte-wide K/V tiles leave room for longer
#: key tiles and deeper pipelines.
NEW_TOKEN_SWEEP_FP8 = ((64, 64, 4, 3, {"TMA": True, "GRID_ORDER": "tiles"}),
                       (64, 64, 4, 3, {"TMA": True, "GRID_ORDER": "heads"}),
                       (64, 64, 4, 3, {"TMA": True, "GRID_ORDER": "group"}))


#: Prefix-partial tiles of a quantized prefill (the path for gathers over WHOLE_CONTEXT_MAX_BYTES)
#: timed by --sweep-new-tokens (as prefill["small_prefix"]):
#: (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_M counts query rows times the GQA group.
PREFIX_TILE_SWEEP = ((128, 128, 8, 2), (128, 64, 4, 3), (256, 64, 8, 3), (256, 128, 8, 2))


def _prefix_tile_variants(args):
    """kvfuse's quantized prefill with every PREFIX_TILE_SWEEP tile for its prefix partials."""
    import dataclasses

    from kvfuse.ops.triton import attention as ta

    base = TILES or ta.DEFAULT_TILES
    fns = {}
    for bm, bn, warps, stages in PREFIX_TILE_SWEEP:
        start = base.prefill.get("small_prefix", base.prefill["small"])
        tile = dataclasses.replace(start, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
        tiles = dataclasses.replace(base, prefill={**base.prefill, "small_prefix": tile})
        call = AttentionCall(*args)
        fns[f"kvfuse prefix m{bm} n{bn} w{warps} s{stages}"] = (
            (lambda call=call, tiles=tiles: ta.paged_attention(call, tiles=tiles, whole_context=False)), True)
    return fns


def _new_token_variants(args, key, value, tile_key="small", sweep=NEW_TOKEN_SWEEP):
    """kvfuse's new-token prefill at every NEW_TOKEN_SWEEP tile (as ``new_tokens[tile_key]``, e.g.
    ``small_fp8`` for an FP8 cache's FP8 dots): {label: (fn, graph)}."""
    import dataclasses

    from kvfuse.ops.triton import attention as ta

    base = TILES or ta.DEFAULT_TILES
    fns = {}
    for bm, bn, warps, stages, fields in sweep:
        start = base.new_tokens.get(tile_key, base.new_tokens["small"])
        tile = dataclasses.replace(start, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages,
                                   **{"TMA": False, **fields})
        tiles = dataclasses.replace(base, new_tokens={**base.new_tokens, tile_key: tile})
        call = AttentionCall(*args, key=key, value=value)
        flags = "".join(f" {name.lower()}" + ("" if on is True else f"={on}") for name, on in fields.items())
        fns[f"kvfuse m{bm} n{bn} w{warps} s{stages}{flags}"] = (
            (lambda call=call, tiles=tiles: ta.paged_attention(call, tiles=tiles)), True)
    return fns


def copy_bandwidth():
    """The device-to-device copy ceiling, measured as in every kvfuse benchmark (benchmarks/common.py)."""
    from benchmarks.common import copy_bandwidth_gb_s

    return copy_bandwidth_gb_s()


# kvfuse's cache names in the results files (the same as cache_write.json's kv_cache_dtype).
KV_CACHE_DTYPE_NAMES = {"bf16": "bfloat16", "fp8": "fp8_e4m3", "nvfp4": "nvfp4", "fp8_pth": "fp8_per_token_head",
                        "fp8/nvfp4": "fp8_e4m3/nvfp4", "bf16/fp8": "bfloat16/fp8_e4m3"}


def _result_row(row):
    """A row in the shared results format: op, impl, kv_cache_dtype, num_tokens, us, gb_per_s, frac_of_copy."""
    out = {k: v for k, v in row.items() if k not in ("cache", "gb_s", "frac_copy")}
    out["kv_cache_dtype"] = KV_CACHE_DTYPE_NAMES.get(row["cache"], row["cache"])
    if "gb_s" in row:
        out["gb_per_s"], out["frac_of_copy"] = row["gb_s"], row["frac_copy"]
    return out


def make_cache(mode, batch, context, device="cuda"):
    """Contiguous-per-sequence pages, shuffled; random finite contents."""
    pages_per_seq = math.ceil(context / PAGE)
    num_blocks = batch * pages_per_seq
    shape = (num_blocks, 2, PAGE, HKV, row_dim_for(mode, HEAD))
    dtype = storage_dtype(mode, torch.bfloat16)
    if mode is KVQuantMode.NVFP4:
        cache = torch.randint(0, 0x70, shape, dtype=torch.uint8, device=device)
    elif mode is KVQuantMode.FP8_PER_TOKEN_HEAD:
        # Finite e4m3 codes of both signs, then each row's float32 scale in its last 4 bytes (rows
        # of differing magnitudes, as per-row scales exist for: 0.005 to 0.02).
        cache = torch.randint(0, 0x7F, shape, dtype=torch.uint8, device=device) ^ torch.randint(
            0, 2, shape, dtype=torch.uint8, device=device) * 0x80
        scales = 0.005 + 0.015 * torch.rand((*shape[:-1], 1), device=device)
        cache[..., HEAD:] = scales.view(torch.uint8)
    else:
        cache = torch.empty(shape, dtype=dtype, device=device)
        flat = cache.view(-1)
        chunk = 1 << 28
        for i in range(0, flat.numel(), chunk):
            flat[i:i + chunk] = torch.randn(min(chunk, flat.numel() - i), device=device, dtype=torch.bfloat16).to(dtype)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    block_table = perm.view(batch, pages_per_seq).contiguous()
    return cache, block_table


def kv_bytes(mode, batch, context):
    return batch * context * HKV * 2 * row_dim_for(mode, HEAD) * storage_dtype(mode, torch.bfloat16).itemsize


def decode_args(mode, batch, context, num_q_heads=HQ):
    """Arguments of ``paged_attention`` for one decode token per sequence over ``context`` tokens."""
    cache, block_table = make_cache(mode, batch, context)
    query = torch.randn(batch, num_q_heads, HEAD, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    scale = torch.tensor(0.5, device="cuda")
    return (query, cache, scale, scale, block_table, seq_lens, qsl, int(mode), 1 / math.sqrt(HEAD), None)


def run_decode(batch, context, mode_name, impls, rows, copy_bw):
    mode = MODES[mode_name]
    args = decode_args(mode, batch, context)
    query, cache, block_table, seq_lens = args[0], args[1], args[4], args[5]
    nbytes = kv_bytes(mode, batch, context)
    fns = {}
    if "kvfuse" in impls:
        fns["kvfuse"] = (_kvfuse(args), True)
    if "kvfuse_native" in impls and mode in (KVQuantMode.FP8_E4M3, KVQuantMode.NVFP4, KVQuantMode.FP8_PER_TOKEN_HEAD):
        from kvfuse.ops import native

        call = AttentionCall(*args)
        fns["kvfuse_native"] = (lambda: native.paged_attention(call), True)
    if mode not in (KVQuantMode.NVFP4, KVQuantMode.FP8_PER_TOKEN_HEAD):  # FlashInfer has neither
        if "kvfuse_flashinfer" in impls:
            from kvfuse.ops import flashinfer as fib

            fns["kvfuse_flashinfer"] = (lambda: fib.paged_attention(AttentionCall(*args)), False)
        for name, tc in (("flashinfer", False), ("flashinfer_tc", True)):
            if name in impls:
                fns[name] = (_flashinfer_decode(query, cache, block_table, seq_lens, mode, tc), True)
        if "torch_sdpa" in impls and mode is KVQuantMode.NONE and nbytes * 2 < 30e9:
            fns["torch_sdpa"] = (_sdpa_decode(query, cache, block_table, batch, context), True)
    for name, (fn, graph) in fns.items():
        _time_decode(dict(op="decode", impl=name, cache=mode_name, batch=batch, context=context,
                          num_tokens=batch * context, kv_bytes=nbytes), fn, graph, rows, copy_bw)
    del args, cache
    torch.cuda.empty_cache()


def _time_decode(row, fn, graph, rows, copy_bw):
    """Time ``fn`` into ``row`` (us, GB/s of its ``kv_bytes``, fraction of copy bandwidth) and append it."""
    nbytes = row["kv_bytes"]
    try:
        us, how = bench_us(fn, reps=10 if nbytes > 4e9 else 20, graph=graph)
        gbs = nbytes / (us * 1e-6) / 1e9
        row.update(us=round(us, 2), gb_s=round(gbs, 1), frac_copy=round(gbs / copy_bw, 3), timing=how)
    except Exception as e:  # keep the sweep going; the row records why
        row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
        traceback.print_exc()
    rows.append(row)
    print(json.dumps(row), flush=True)


def make_mixed_cache(fmt, batch, context, scale, device="cuda"):
    """A mixed-format cache (pages of :func:`kvfuse.kv_cache.mixed_page_layout`) holding N(0, 1) K/V
    encoded by kvfuse's reference writer, contiguous-per-sequence pages shuffled; and its block table."""
    from kvfuse.ops import reference

    pages_per_seq = math.ceil(context / PAGE)
    num_blocks = batch * pages_per_seq
    layout = mixed_page_layout(fmt, PAGE, HKV, HEAD, torch.bfloat16)
    cache = torch.empty((num_blocks, 2, PAGE, HKV, layout.row_dim), dtype=torch.uint8, device=device)
    chunk = 16384  # tokens per write: the reference's page-index gather is [tokens, HKV, row bytes] int64
    for first in range(0, num_blocks * PAGE, chunk):
        slots = torch.arange(first, min(first + chunk, num_blocks * PAGE), device=device)
        k, v = torch.randn(2, slots.numel(), HKV, HEAD, device=device, dtype=torch.bfloat16)
        reference.encode_and_cache_write(k, v, cache, slots, scale, scale, fmt.code)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    return cache, perm.view(batch, pages_per_seq).contiguous(), layout


def run_mixed_decode(name, impls, rows, copy_bw):
    """kvfuse's decode over a mixed-format cache (MIXED_MODES[name]) at each of MIXED_DECODE_CASES."""
    if "kvfuse" not in impls:
        return
    fmt = KVFormat(*MIXED_MODES[name])
    for batch, context in MIXED_DECODE_CASES:
        scale = torch.tensor(0.5, device="cuda")
        cache, block_table, layout = make_mixed_cache(fmt, batch, context, scale)
        query = torch.randn(batch, HQ, HEAD, device="cuda", dtype=torch.bfloat16)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        args = (query, cache, scale, scale, block_table, seq_lens, qsl, fmt, 1 / math.sqrt(HEAD), None)
        nbytes = batch * context * HKV * sum(layout.row_bytes)
        _time_decode(dict(op="decode", impl="kvfuse", cache=name, batch=batch, context=context,
                          num_tokens=batch * context, kv_bytes=nbytes), _kvfuse(args), True, rows, copy_bw)
        del args, cache
        torch.cuda.empty_cache()


def _flashinfer_decode(query, cache, block_table, seq_lens, mode, tensor_cores):
    import flashinfer

    batch, pages = block_table.shape
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages
    last = seq_lens - (pages - 1) * PAGE
    wrapper.plan(indptr, block_table.reshape(-1), last.to(torch.int32), HQ, HKV, HEAD, PAGE,
                 q_data_type=query.dtype, kv_data_type=cache.dtype, sm_scale=1 / math.sqrt(HEAD))
    scales = dict(k_scale=0.5, v_scale=0.5) if mode is not KVQuantMode.NONE else {}
    return lambda: wrapper.run(query, cache, **scales)


def _sdpa_decode(query, cache, block_table, batch, context):
    # The gather to a contiguous cache is done once, outside the timing: SDPA's own speed.
    k = cache[block_table.long(), 0].reshape(batch, -1, HKV, HEAD)[:, :context].transpose(1, 2).contiguous()
    v = cache[block_table.long(), 1].reshape(batch, -1, HKV, HEAD)[:, :context].transpose(1, 2).contiguous()
    q = query.view(batch, HQ, 1, HEAD)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def run_prefill(tokens, mode_name, impls, rows, copy_bw):
    mode = MODES[mode_name]
    cache, block_table = make_cache(mode, 1, tokens)
    query = torch.randn(tokens, HQ, HEAD, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    ks = torch.tensor(0.5, device="cuda")
    vs = torch.tensor(0.5, device="cuda")
    args = (query, cache, ks, vs, block_table, seq_lens, qsl, int(mode), 1 / math.sqrt(HEAD), None)
    flops = 4 * HQ * HEAD * tokens * (tokens + 1) / 2
    nbytes = kv_bytes(mode, 1, tokens)
    fns = _kvfuse_rows(args, impls, tokens, sweep=SWEEP_NEW_TOKENS)
    if mode is KVQuantMode.NONE:
        if "kvfuse_flashinfer" in impls:
            from kvfuse.ops import flashinfer as fib

            fns["kvfuse_flashinfer"] = (lambda: fib.paged_attention(AttentionCall(*args)), False)
        if "flashinfer" in impls:
            import flashinfer

            ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            pages = block_table.shape[1]
            w.plan(qsl, torch.tensor([0, pages], dtype=torch.int32, device="cuda"), block_table.reshape(-1),
                   (seq_lens - (pages - 1) * PAGE).to(torch.int32), HQ, HKV, HEAD, PAGE, causal=True,
                   q_data_type=query.dtype, kv_data_type=cache.dtype, sm_scale=1 / math.sqrt(HEAD))
            fns["flashinfer"] = (lambda: w.run(query, cache), True)
        if "torch_sdpa" in impls:
            k = cache[block_table.long(), 0].reshape(1, -1, HKV, HEAD)[:, :tokens].transpose(1, 2).contiguous()
            v = cache[block_table.long(), 1].reshape(1, -1, HKV, HEAD)[:, :tokens].transpose(1, 2).contiguous()
            q = query.view(1, tokens, HQ, HEAD).transpose(1, 2)
            fns["torch_sdpa"] = (lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True), True)
    _time_flops(fns, dict(op="prefill", cache=mode_name, batch=1, context=tokens, num_tokens=tokens), flops, nbytes,
                rows, copy_bw)
    del cache
    torch.cuda.empty_cache()


def _time_flops(fns, case, flops, nbytes, rows, copy_bw):
    """Time each ``fns[impl] = (fn, graph)`` ROUNDS times, round-robin, and append its row: the
    median us (and every round's), TFLOP/s, GB/s of KV read and the fraction of copy bandwidth; a
    failing implementation records its error and the rest go on."""
    times = {impl: [] for impl in fns}
    errors, hows = {}, {}
    for _ in range(ROUNDS):
        for impl, (fn, graph) in fns.items():
            if impl in errors:
                continue
            try:
                us, hows[impl] = bench_us(fn, reps=10, graph=graph)
                times[impl].append(us)
            except Exception as e:
                errors[impl] = f"{type(e).__name__}: {str(e)[:200]}"
                traceback.print_exc()
    for impl in fns:
        row = dict(case, impl=impl, kv_bytes=nbytes)
        if impl in errors:
            row.update(error=errors[impl])
        else:
            us = statistics.median(times[impl])
            row.update(us=round(us, 2), tflops=round(flops / (us * 1e-6) / 1e12, 1), timing=hows[impl],
                       gb_s=round(nbytes / (us * 1e-6) / 1e9, 1),
                       frac_copy=round(nbytes / (us * 1e-6) / 1e9 / copy_bw, 3))
            if ROUNDS > 1:
                row["us_rounds"] = [round(t, 2) for t in times[impl]]
        rows.append(row)
        print(json.dumps(row), flush=True)


#: Issue 16's append cases: (name, batch, cached prefix, new tokens per sequence).
EXTEND_CASES = (("chunked_prefill", 8, 4096, 512), ("spec_decode", 64, 4096, 4))


def run_extend(case, mode_name, impls, rows, copy_bw):
    """New tokens attending to a cached prefix plus themselves (causal among the new tokens):
    chunked prefill / prefix caching, and speculative-decoding queries. The cache already holds
    the new tokens' K/V (the write comes first in a layer), as both kvfuse and FlashInfer read it."""
    name, batch, prefix, new = case
    mode = MODES[mode_name]
    context = prefix + new
    cache, block_table = make_cache(mode, batch, context)
    query = torch.randn(batch * new, HQ, HEAD, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * new
    scale = torch.tensor(0.5, device="cuda")
    args = (query, cache, scale, scale, block_table, seq_lens, qsl, int(mode), 1 / math.sqrt(HEAD), None)
    flops = 4 * HQ * HEAD * batch * new * (prefix + (new + 1) / 2)
    nbytes = kv_bytes(mode, batch, context)
    fns = _kvfuse_rows(args, impls, new, sweep=SWEEP_NEW_TOKENS, cached_prefix=prefix > 0)
    if "flashinfer" in impls and mode in (KVQuantMode.NONE, KVQuantMode.FP8_E4M3):
        import flashinfer

        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        pages = block_table.shape[1]
        w.plan(qsl, torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages, block_table.reshape(-1),
               (seq_lens - (pages - 1) * PAGE).to(torch.int32), HQ, HKV, HEAD, PAGE, causal=True,
               q_data_type=query.dtype, kv_data_type=cache.dtype, sm_scale=1 / math.sqrt(HEAD))
        scales = dict(k_scale=0.5, v_scale=0.5) if mode is not KVQuantMode.NONE else {}
        fns["flashinfer"] = (lambda: w.run(query, cache, **scales), True)
    _time_flops(fns, dict(op=name, cache=mode_name, batch=batch, context=context, num_tokens=batch * new), flops,
                nbytes, rows, copy_bw)
    del cache
    torch.cuda.empty_cache()


def tune(log):
    """Sweep the Triton tiles on the anchor shapes; use the fastest for the rest of the run (TILES)."""
    import itertools

    from kvfuse.ops.triton import attention as ta

    global TILES
    decode, prefill = dict(ta.DEFAULT_TILES.decode), dict(ta.DEFAULT_TILES.prefill)
    results = {}
    for key, mode_name in (("small", "bf16"), ("small_fp8", "fp8"), ("small_nvfp4", "nvfp4")):
        mode = MODES[mode_name]
        args = decode_args(mode, 64, 4096)
        best = None
        for bn, warps, stages in itertools.product((64, 128, 256), (4, 8), (2, 3)):
            tile = ta.Tile(BLOCK_M=16, BLOCK_N=bn, num_warps=warps, num_stages=stages)
            tiles = ta.TileTable({**decode, key: tile}, prefill, ta.DEFAULT_TILES.interpret)
            call = AttentionCall(*args)
            try:
                us, _ = bench_us(lambda: ta.paged_attention(call, tiles=tiles), reps=10)
            except Exception as e:
                log.append(f"decode {mode_name} {bn}/{warps}/{stages}: {type(e).__name__}")
                continue
            log.append(f"decode {mode_name} BLOCK_N={bn} warps={warps} stages={stages}: {us:.1f} us")
            if best is None or us < best[0]:
                best = (us, tile)
        if best:
            decode[key] = best[1]
            results[key] = best
        del args
        torch.cuda.empty_cache()
    cache, bt = make_cache(KVQuantMode.NONE, 1, 16384)
    q = torch.randn(16384, HQ, HEAD, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([16384], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, 16384], dtype=torch.int32, device="cuda")
    one = torch.tensor(1.0, device="cuda")
    call = AttentionCall(q, cache, one, one, bt, lens, qsl, KVQuantMode.NONE, 0.088, None)
    best = None
    for bm, bn, warps, stages in ((128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
                                  (128, 64, 4, 3), (64, 128, 4, 2)):
        tile = ta.Tile(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
        tiles = ta.TileTable(decode, {**prefill, "small": tile}, ta.DEFAULT_TILES.interpret)
        try:
            us, _ = bench_us(lambda: ta.paged_attention(call, tiles=tiles), reps=3)
        except Exception as e:
            log.append(f"prefill {bm}/{bn}/{warps}/{stages}: {type(e).__name__}")
            continue
        log.append(f"prefill 16k BLOCK_M={bm} BLOCK_N={bn} warps={warps} stages={stages}: {us:.1f} us")
        if best is None or us < best[0]:
            best = (us, tile)
    if best:
        prefill["small"] = best[1]
        results["prefill_small"] = best
    del cache, call
    torch.cuda.empty_cache()
    TILES = ta.TileTable(decode, prefill, ta.DEFAULT_TILES.interpret)
    for line in log:
        print(line, flush=True)
    tuned = {k: dataclasses.asdict(v[1]) for k, v in results.items()}
    print("tuned:", json.dumps(tuned), flush=True)
    return tuned


def write_results(rows, meta, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "attention.json"), "w") as f:
        json.dump(dict(device=meta["device"], date=meta["date"], commit=meta["commit"],
                       copy_gb_per_s=meta["copy_gb_s"], meta=meta, rows=[_result_row(r) for r in rows]), f, indent=1)
    ok = [r for r in rows if "us" in r]
    lines = [f"### Paged attention ({meta['device']}, {meta['date']}, commit {meta['commit']})", "",
             f"`{meta['command']}`; copy bandwidth {meta['copy_gb_s']:.0f} GB/s (same run). "
             "us per call, GB/s of KV read, fraction of copy bandwidth.", "",
             "| op | cache | batch | context | impl | us | GB/s | x copy BW | anchor |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in ok:
        anchor = ANCHORS.get((r["op"], r["cache"], r["batch"], r["context"]))
        a = f"{anchor[0]} {anchor[1]:.0f} us ({anchor[2]:.0%})" if anchor and anchor[0] == r["impl"] else ""
        extra = f" ({r['tflops']} TFLOP/s)" if "tflops" in r else ""
        lines.append(f"| {r['op']} | {r['cache']} | {r['batch']} | {r['context']} | {r['impl']} | {r['us']:.1f}{extra} "
                     f"| {r['gb_s']:.0f} | {r['frac_copy']:.2f} | {a} |")
    errs = [r for r in rows if "error" in r]
    if errs:
        lines += ["", "Failed: " + "; ".join(f"{r['impl']}/{r['cache']}/B{r['batch']}/ctx{r['context']}: "
                                            f"{r['error']}" for r in errs)]
    with open(os.path.join(out_dir, "attention.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), sharey=True)
        for ax, mode_name in zip(axes, MODES):
            sub = [r for r in ok if r["op"] == "decode" and r["cache"] == mode_name]
            impls = sorted({r["impl"] for r in sub})
            cases = sorted({(r["batch"], r["context"]) for r in sub})
            width = 0.8 / max(1, len(impls))
            for i, impl in enumerate(impls):
                vals = [next((r["frac_copy"] for r in sub if r["impl"] == impl and (r["batch"], r["context"]) == c), 0)
                        for c in cases]
                ax.bar([j + i * width for j in range(len(cases))], vals, width, label=impl)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
            ax.set_xticklabels([f"B{b}\n{c // 1024}k" for b, c in cases], fontsize=7)
            ax.set_title(f"decode, {mode_name} cache")
            ax.axhline(1.0, color="gray", lw=0.5)
            ax.legend(fontsize=7)
        axes[0].set_ylabel("fraction of copy bandwidth (KV bytes read)")
        fig.suptitle(f"paged attention decode, {meta['device']}, 32q/8kv heads, D=128, page 16")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "attention.png"), dpi=110)
    except Exception:
        traceback.print_exc()


# Decode variants compared by --focus: (name, cache, launcher options, tile overrides).
FOCUS_VARIANTS = [
    ("default", "bf16", {}, {}),
    ("bf16dot n128 w4 s2", "fp8", {"quant_dot_fp16": False}, dict(BLOCK_N=128, num_warps=4, num_stages=2)),
    ("fp16dot n128 w4 s2", "fp8", {}, dict(BLOCK_N=128, num_warps=4, num_stages=2)),
    ("fp16dot n128 w8 s2", "fp8", {}, dict(BLOCK_N=128, num_warps=8, num_stages=2)),
    ("triton bcast n64 w4 s3", "nvfp4", {"inline_asm": False}, dict(BLOCK_N=64, num_warps=4, num_stages=3,
                                                                        SCALE_GATHER=False)),
    ("ptx gather n64 w4 s3", "nvfp4", {}, dict(BLOCK_N=64, num_warps=4, num_stages=3, SCALE_GATHER=True)),
    ("ptx bcast n64 w4 s3", "nvfp4", {}, dict(BLOCK_N=64, num_warps=4, num_stages=3, SCALE_GATHER=False)),
    ("ptx bcast n128 w4 s2", "nvfp4", {}, dict(BLOCK_N=128, num_warps=4, num_stages=2, SCALE_GATHER=False)),
    ("ptx bcast n128 w8 s2", "nvfp4", {}, dict(BLOCK_N=128, num_warps=8, num_stages=2, SCALE_GATHER=False)),
    # Scores as (K @ q^T)^T: the key tile becomes the dot's first operand.
    ("keys-first n128 w4 s2", "fp8", {}, dict(BLOCK_N=128, num_warps=4, num_stages=2, KEYS_FIRST=True)),
    # Register caps: 255 registers per thread allow 2 programs per SM (ncu: 12.5% occupancy).
    ("fp16dot n128 w4 s2 r168", "fp8", {}, dict(BLOCK_N=128, num_warps=4, num_stages=2, MAXNREG=168)),
    ("fp16dot n128 w4 s2 r128", "fp8", {}, dict(BLOCK_N=128, num_warps=4, num_stages=2, MAXNREG=128)),
    ("keys-first n128 w4 s2 r168", "fp8", {}, dict(BLOCK_N=128, num_warps=4, num_stages=2, KEYS_FIRST=True,
                                                  MAXNREG=168)),
    ("fp16dot n64 w4 s3 r128", "fp8", {}, dict(BLOCK_N=64, num_warps=4, num_stages=3, MAXNREG=128)),
    # The default FP8 tile spills 14 operations per key-loop iteration at 128 registers, none at 168.
    ("fp16dot n64 w4 s3 r168", "fp8", {}, dict(BLOCK_N=64, num_warps=4, num_stages=3, MAXNREG=168)),
    # More programs than SM slots: split-KV at batch 64 (3 and 5 splits), against the wave tail.
    ("split3 n128 w4 s2", "fp8", {"num_splits": 3}, dict(BLOCK_N=128, num_warps=4, num_stages=2)),
    ("split5 n128 w4 s2", "fp8", {"num_splits": 5}, dict(BLOCK_N=128, num_warps=4, num_stages=2)),
    ("ptx bcast n128 w4 s2 r168", "nvfp4", {}, dict(BLOCK_N=128, num_warps=4, num_stages=2, SCALE_GATHER=False,
                                                   MAXNREG=168)),
    ("ptx bcast n128 w4 s2 r128", "nvfp4", {}, dict(BLOCK_N=128, num_warps=4, num_stages=2, SCALE_GATHER=False,
                                                   MAXNREG=128)),
    ("split3 bcast n128 w4 s2", "nvfp4", {"num_splits": 3}, dict(BLOCK_N=128, num_warps=4, num_stages=2,
                                                                       SCALE_GATHER=False)),
    # Block scales through 32-bit words: asynchronous copies in the key loop's pipeline instead of
    # synchronous byte loads (benchmarks/sass_attention.py shows the difference in the SASS).
    ("ptx bcast n128 w4 s2 r128 words", "nvfp4", {}, dict(BLOCK_N=128, num_warps=4, num_stages=2,
                                                         SCALE_GATHER=False, MAXNREG=128, WORD_SCALES=True)),
    ("ptx bcast n128 w4 s3 r128 words", "nvfp4", {}, dict(BLOCK_N=128, num_warps=4, num_stages=3,
                                                         SCALE_GATHER=False, MAXNREG=128, WORD_SCALES=True)),
    ("ptx gather n64 w4 s3 words", "nvfp4", {}, dict(BLOCK_N=64, num_warps=4, num_stages=3, SCALE_GATHER=True,
                                                    WORD_SCALES=True)),
    # Per-token-head FP8 has its own tile: uncapped (at the per-tensor FP8 tile's 128-register cap
    # its key loop spilled 69 local-memory operations per iteration) and reading pages ahead.
    ("pth default", "fp8_pth", {}, {}),
    ("pth r128 inplace pages", "fp8_pth", {}, dict(MAXNREG=128, PREFETCH_PAGES=False)),
    ("pth uncapped inplace pages", "fp8_pth", {}, dict(PREFETCH_PAGES=False)),
    ("pth n128 w4 s2", "fp8_pth", {}, dict(BLOCK_N=128, num_stages=2)),
    ("pth n32 w4 s4", "fp8_pth", {}, dict(BLOCK_N=32, num_stages=4)),
    ("pth n64 w8 s3", "fp8_pth", {}, dict(num_warps=8)),
    # Block-table entries read one iteration ahead (on in the FP8 and NVFP4 defaults) against in place.
    ("fp8 default", "fp8", {}, {}),
    ("fp8 inplace pages", "fp8", {}, dict(PREFETCH_PAGES=False)),
    ("nvfp4 default", "nvfp4", {}, {}),
    ("nvfp4 inplace pages", "nvfp4", {}, dict(PREFETCH_PAGES=False)),
]


def focus(out_dir, copy_bw):
    """Decode at batch 64 / context 4096 for every FOCUS_VARIANTS entry, then batch 16 / context 16k
    with the best variant per cache. Rows go to ``attention_decode_focus.json``; a table is printed last."""
    from kvfuse.ops.triton import attention as ta

    key_of = {"bf16": "small", "fp8": "small_fp8", "nvfp4": "small_nvfp4", "fp8_pth": "small_fp8_pth"}
    rows, best = [], {}

    def one(label, mode_name, batch, context, fn_of, num_q_heads=HQ):
        mode = MODES[mode_name]
        args = decode_args(mode, batch, context, num_q_heads)
        nbytes = kv_bytes(mode, batch, context)
        row = dict(op="decode", impl="kvfuse", variant=label, cache=mode_name, batch=batch, context=context,
                   num_tokens=batch * context, kv_bytes=nbytes, num_q_heads=num_q_heads)
        try:
            us, how = bench_us(fn_of(args), reps=20)
            gbs = nbytes / (us * 1e-6) / 1e9
            row.update(us=round(us, 2), gb_s=round(gbs, 1), frac_copy=round(gbs / copy_bw, 3), timing=how)
        except Exception as e:
            row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc()
        del args
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    def variant_fn(knobs, cfg, key):
        def make(args):
            decode = dict(ta.DEFAULT_TILES.decode)
            decode[key] = dataclasses.replace(decode[key], **cfg)
            tiles = ta.TileTable(decode, ta.DEFAULT_TILES.prefill, ta.DEFAULT_TILES.interpret)
            call = AttentionCall(*args)
            return lambda: ta.paged_attention(call, tiles=tiles, **knobs)
        return make

    only = os.environ.get("BENCH_FOCUS_ONLY")  # comma-separated variant labels, for short runs
    for mode_name in ("bf16", "fp8", "nvfp4", "fp8_pth"):
        for label, m, knobs, cfg in FOCUS_VARIANTS:
            if m != mode_name or (only and label not in only.split(",")):
                continue
            row = one(label, m, 64, 4096, variant_fn(knobs, cfg, key_of[m]))
            if "us" in row and (m not in best or row["us"] < best[m][0]):
                best[m] = (row["us"], label, knobs, cfg)
    for mode_name, (_, label, knobs, cfg) in best.items():
        one(label, mode_name, 16, 16384, variant_fn(knobs, cfg, key_of[mode_name]))
        # The demo model's shape (16 query / 8 KV heads), which decode_step.py times per layer.
        for name, k, c in ((label, knobs, cfg), ("default", {}, {})):
            if name != label or mode_name != "bf16":
                one(name, mode_name, 64, 4096, variant_fn(k, c, key_of[mode_name]), num_q_heads=16)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "attention_decode_focus.json"), "w") as f:
        json.dump(dict(copy_gb_s=round(copy_bw, 1), device=torch.cuda.get_device_name(),
                       commit=current_commit(), rows=rows), f, indent=1)
    print(f"\ncopy bandwidth {copy_bw:.0f} GB/s")
    print(f"{'cache':6} {'B':>3} {'ctx':>6} {'hq':>3} {'variant':26} {'us':>8} {'GB/s':>7} {'xcopy':>6}")
    for r in rows:
        head = f"{r['cache']:6} {r['batch']:3} {r['context']:6} {r['num_q_heads']:3} {r['variant']:26}"
        if "us" in r:
            print(f"{head} {r['us']:8.1f} {r['gb_s']:7.0f} {r['frac_copy']:6.2f}")
        else:
            print(f"{head} ERROR {r['error'][:80]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batch 64 / context 4096 decode + 4k prefill only")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--impls", default="kvfuse,kvfuse_native,kvfuse_flashinfer,flashinfer,flashinfer_tc,torch_sdpa",
                        help="kvfuse: the Triton kernels; kvfuse_native: csrc/'s decode kernel (FP8, per-token-head FP8, "
                             "NVFP4) and prefill kernel (bf16, FP8, NVFP4 on sm_90)")
    parser.add_argument("--decode-cases", default=None, metavar="B:CTX,...",
                        help="decode (batch, context) pairs to time instead of the default grid")
    parser.add_argument("--modes", default="bf16,fp8,nvfp4,fp8_pth")
    parser.add_argument("--mixed-modes", default=",".join(MIXED_MODES),
                        help=f"mixed K/V formats timed at decode (comma-separated, of {list(MIXED_MODES)}; "
                             f"'' for none)")
    parser.add_argument("--tune", action="store_true", help="sweep Triton block configs first and use the best")
    parser.add_argument("--focus", action="store_true",
                        help="only decode at B=64/4k and B=16/16k: kernel variants and configs side by side")
    parser.add_argument("--tile", action="append", default=[], metavar="FIELD=VALUE",
                        help="set a Tile field in every kvfuse tile for this run (e.g. PREFETCH_PAGES=1, "
                             "WORD_SCALES=1, MAXNREG=none); repeatable")
    parser.add_argument("--only", default="decode,prefill,extend",
                        help="which parts of the matrix to run (comma-separated: decode, prefill, extend)")
    parser.add_argument("--prefills", default=None,
                        help="prefill token counts (comma-separated; default 4096 with --quick, else 4096,16384)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="prefill/append cases: time every implementation this many times, round-robin, "
                             "and report the median")
    parser.add_argument("--sweep-new-tokens", action="store_true",
                        help="also time the new-token prefill kernel at every NEW_TOKEN_SWEEP tile (bf16 prefill)")
    args = parser.parse_args()
    global SWEEP_NEW_TOKENS, ROUNDS
    SWEEP_NEW_TOKENS = args.sweep_new_tokens
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be >= 1")
    ROUNDS = args.rounds
    if args.tile:
        global TILES
        from kvfuse.ops.triton import attention as ta

        try:
            TILES = ta.DEFAULT_TILES.replace(**tile_fields(args.tile))
        except ValueError as e:
            parser.error(str(e))
    impls = set(args.impls.split(","))
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        impls -= {"kvfuse_flashinfer", "flashinfer", "flashinfer_tc"}
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    if args.focus:
        focus(args.out, copy_bw)
        return
    batches, contexts, prefills = ([64], [4096], [4096]) if args.quick else ([1, 16, 64, 256], [1024, 4096, 16384],
                                                                           [4096, 16384])
    tuned = tune([]) if args.tune else None
    if args.prefills:
        prefills = [int(t) for t in args.prefills.split(",")]
    parts = set(args.only.split(","))
    if parts - {"decode", "prefill", "extend"}:
        parser.error(f"--only {args.only!r}: allowed parts are decode, prefill, extend")
    mixed_modes = [name for name in args.mixed_modes.split(",") if name]
    if set(mixed_modes) - set(MIXED_MODES):
        parser.error(f"--mixed-modes {args.mixed_modes!r}: allowed names are {list(MIXED_MODES)}")
    rows = []
    meta = _meta(args, copy_bw, tuned)
    decode_cases = [(b, c) for b in batches for c in contexts]
    if args.decode_cases:
        try:
            decode_cases = [tuple(int(x) for x in pair.split(":")) for pair in args.decode_cases.split(",")]
        except ValueError:
            parser.error(f"--decode-cases {args.decode_cases!r}: expected BATCH:CONTEXT pairs, comma-separated")
    for mode_name in args.modes.split(",") if "decode" in parts else ():
        for batch, context in decode_cases:
            run_decode(batch, context, mode_name, impls, rows, copy_bw)
        write_results(rows, meta, args.out)  # partial results survive a timeout
    for name in mixed_modes if "decode" in parts else ():
        run_mixed_decode(name, impls, rows, copy_bw)
        write_results(rows, meta, args.out)
    for tokens in prefills if "prefill" in parts else ():
        for mode_name in args.modes.split(","):
            run_prefill(tokens, mode_name, impls, rows, copy_bw)
        write_results(rows, meta, args.out)
    for case in EXTEND_CASES if "extend" in parts else ():
        for mode_name in args.modes.split(","):
            run_extend(case, mode_name, impls, rows, copy_bw)
    write_results(rows, meta, args.out)



def _meta(args, copy_bw, tuned):
    return dict(
        date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
        commit=current_commit(), command="python -m benchmarks.attention"
        + (" --quick" if args.quick else "") + (" --tune" if args.tune else "")
        + "".join(f" --tile {f}" for f in args.tile), copy_gb_s=round(copy_bw, 1),
        torch=torch.__version__, tuned_configs=tuned,
    )



# Read (as text) by `python -m kvfuse bench`, which refuses to start this on a host without CUDA.
REQUIRES_CUDA = True


if __name__ == "__main__":
    main()
