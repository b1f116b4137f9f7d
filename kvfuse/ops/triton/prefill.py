"""Prefill attention that reads the new tokens' keys and values from the step's own K/V tensors.

A prompt (or a prompt chunk) writes its K/V into the cache and then attends to them. For a cache
that stores the model dtype (bf16 / fp16, ``KVQuantMode.NONE``) the rows just written are equal
to the ``key`` / ``value`` tensors the write consumed, so those newest ``q_len`` keys of every
sequence can be read from the contiguous tensors (no block-table lookup, no page gather), and
only the cached prefix from the pages.

A program owns ``BLOCK_M`` consecutive query tokens of one sequence and one query head (head
``h`` reads KV head ``h // GROUP``; the group's programs share K/V through L2). With ``P =
seq_len - q_len`` cached positions before the new tokens, query token ``i`` sits at position
``P + i`` and attends to

    prefix keys    0 <= j < P        from the pages (every row sees all of them)
    new keys       0 <= i' <= i      from ``key[q_start + i']`` (causal)

in one base-2 online softmax with fp32 accumulators (the math of
:mod:`kvfuse.ops.triton.attention`; for the new keys the scale is folded into the exponent, see
:func:`_scaled_softmax_update`). New keys below the tile's first token are visible to every
row and run unmasked; only the diagonal block ``[m0, m0 + BLOCK_M)`` is masked, which is why
``BLOCK_M`` is a multiple of ``BLOCK_N``.

With ``Tile.TMA`` the query tile and the new K/V tiles are read through tensor descriptors over
the ``[tokens, heads * head_size]`` views (:func:`descriptors`): on Hopper the tensor memory
accelerator copies whole tiles into shared memory, which frees the registers and issue slots
that per-element addresses take, and is what let a 64-token tile with one warpgroup run faster
than the 128-token tile (BENCHMARKS.md, prefill). A tile that crosses the end of its sequence
reads the next sequence's rows (or zeros past the tensor): those keys sit after every real
query of the tile and are masked, those query rows are never stored. Layouts a descriptor cannot
describe fall back to pointer loads, with the same results.

What it does not take (the launcher in :mod:`.attention` routes those calls to the paged
kernel): quantized caches (their cached bytes differ from the model-dtype K/V) including mixed
formats (one side quantized), sliding windows,
float32 queries and decode-sized batches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import envs
from ...kv_cache import KVQuantMode
from ..registry import AttentionCall
from .attention import (
    _LOG2E,
    Tile,
    TileTable,
    _attend_range,
    _next_pow2,
    _row_align,
    _softcap,
    _softmax_update,
    _tile_sequence,
)

__all__ = ["new_token_prefill", "takes"]


@triton.jit
def _scaled_softmax_update(s, allowed, m_i, l_i, qk_scale, cap, MASKED: tl.constexpr, SOFTCAP: tl.constexpr):
    """Online-softmax step on raw dot products ``s`` (not yet times ``qk_scale``): (p, alpha, m, l).

    Without a soft cap the scale is folded into the exponent, ``2^(s * qk_scale - m)`` with ``m =
    max(s) * qk_scale`` (``qk_scale > 0``), one fused multiply-add per score instead of a multiply
    and a subtract. Unmasked ranges see every key, so their maximum is finite and needs no guard
    against -inf; masked (diagonal) blocks keep the guard of :func:`_softmax_update`."""
    if SOFTCAP:
        p, alpha, m_new, l_new = _softmax_update(_softcap(s * qk_scale, cap, True), allowed, m_i, l_i, MASKED)
    elif MASKED:
        s = tl.where(allowed, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_new = l_i * alpha + tl.sum(p, 1)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def _attend_new_keys(
    acc, m_i, l_i, q, tok, lo, hi, qk_scale, cap, k_rows, v_rows, stride_kt, stride_vt,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    DOT_DTYPE: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """New keys ``[lo, hi)`` (indices into the sequence's new tokens) for query tokens ``tok``.

    MASKED: the diagonal block (causality, and ``hi`` inside the last tile); unmasked ranges are
    whole tiles that every row sees, loaded without masks."""
    offs_d = tl.arange(0, HEAD_PAD)
    dmask = offs_d < HEAD
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        kmask = j < hi
        if MASKED or HEAD != HEAD_PAD:
            lmask = dmask[:, None]
            if MASKED:
                lmask = lmask & kmask[None, :]
            k = tl.load(k_rows + j[None, :].to(tl.int64) * stride_kt + offs_d[:, None], mask=lmask, other=0.0)
            v = tl.load(v_rows + j[:, None].to(tl.int64) * stride_vt + offs_d[None, :], mask=tl.trans(lmask),
                        other=0.0)
        else:
            k = tl.load(k_rows + j[None, :].to(tl.int64) * stride_kt + offs_d[:, None])
            v = tl.load(v_rows + j[:, None].to(tl.int64) * stride_vt + offs_d[None, :])
        s = tl.dot(q, k.to(DOT_DTYPE))
        allowed = kmask[None, :] & (j[None, :] <= tok[:, None])
        p, alpha, m_i, l_i = _scaled_softmax_update(s, allowed, m_i, l_i, qk_scale, cap, MASKED, SOFTCAP)
        acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None])
    return acc, m_i, l_i


@triton.jit
def _attend_new_keys_tma(
    acc, m_i, l_i, q, tok, lo, hi, qk_scale, cap, k_desc, v_desc, row0, col,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_DTYPE: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """:func:`_attend_new_keys` through tensor descriptors: key/value rows ``row0 + [lo, hi)`` at
    column ``col`` of the ``[tokens, heads * head_size]`` views. Rows past the tensor read as zeros;
    rows past ``hi`` (the next sequence's) are masked like any key after the query."""
    for start in range(lo, hi, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        k = k_desc.load([row0 + start, col])
        s = tl.dot(q, k.to(DOT_DTYPE).T)
        j = start + tl.arange(0, BLOCK_N)
        allowed = j[None, :] <= tok[:, None]
        p, alpha, m_i, l_i = _scaled_softmax_update(s, allowed, m_i, l_i, qk_scale, cap, MASKED, SOFTCAP)
        v = v_desc.load([row0 + start, col])
        acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None])
    return acc, m_i, l_i


@triton.jit
def _new_token_prefill_kernel(
    q_ptr, k_ptr, v_ptr, q_desc, k_desc, v_desc, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, sinks_ptr, out_ptr,
    qk_scale, cap, num_seqs,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, DOT_DTYPE: tl.constexpr, ROW_ALIGN: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, PREFETCH_PAGES: tl.constexpr, LONGEST_FIRST: tl.constexpr,
    TMA: tl.constexpr,
):
    """One (query tile, query head): BLOCK_M new tokens of one sequence over its prefix and itself."""
    tile = tl.program_id(0)
    if LONGEST_FIRST:
        tile = tl.num_programs(0) - 1 - tile
    h = tl.program_id(1)
    kvh = h // GROUP

    b, q_start, q_len, local = _tile_sequence(qsl_ptr, tile, num_seqs, BLOCK_M)
    prefix = tl.load(seq_lens_ptr + b) - q_len
    # Metadata with fewer cached positions than new tokens (refused by the op's checks) keeps
    # the zeros the launcher filled in.
    if (local < 0) | (local * BLOCK_M >= q_len) | (prefix < 0):
        return

    m0 = local * BLOCK_M
    tok = m0 + tl.arange(0, BLOCK_M)
    row_ok = tok < q_len
    rows = (q_start + tok).to(tl.int64)
    offs_d = tl.arange(0, HEAD_PAD)
    qmask = row_ok[:, None] & (offs_d[None, :] < HEAD)
    if TMA:
        q = q_desc.load([q_start + m0, h * HEAD])
    else:
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=qmask, other=0.0)
    q = q.to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        # The sink: a virtual key of value zero that seeds the running max and denominator.
        sink = tl.load(sinks_ptr + h + tok * 0) * 1.4426950408889634
        m_i = sink
        l_i = tl.where(sink == float("-inf"), 0.0, 1.0)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)

    # The cached prefix, from the pages: whole tiles unmasked, then the partial one masked.
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    qpos = prefix + tok
    whole = prefix // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, qpos, 0, whole, 0, qk_scale, cap, cache_ptr, bt_row, kvh, stride_cb, stride_ckv,
        stride_cs, stride_ch, HEAD, HEAD_PAD, BLOCK_N, PAGE, False, False, DOT_DTYPE, "tf32", ROW_ALIGN,
        False, SOFTCAP, False, PREFETCH_PAGES)
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, qpos, whole, prefix, 0, qk_scale, cap, cache_ptr, bt_row, kvh, stride_cb, stride_ckv,
        stride_cs, stride_ch, HEAD, HEAD_PAD, BLOCK_N, PAGE, True, False, DOT_DTYPE, "tf32", ROW_ALIGN,
        False, SOFTCAP, False, False)

    # The new tokens, from the step's K/V: every row sees [0, m0); the diagonal block is masked.
    diagonal_end = tl.minimum(m0 + BLOCK_M, q_len)
    if TMA:
        acc, m_i, l_i = _attend_new_keys_tma(acc, m_i, l_i, q, tok, 0, m0, qk_scale, cap, k_desc, v_desc, q_start,
                                             kvh * HEAD, BLOCK_N, False, DOT_DTYPE, SOFTCAP)
        acc, m_i, l_i = _attend_new_keys_tma(acc, m_i, l_i, q, tok, m0, diagonal_end, qk_scale, cap, k_desc, v_desc,
                                             q_start, kvh * HEAD, BLOCK_N, True, DOT_DTYPE, SOFTCAP)
    else:
        k_rows = k_ptr + q_start.to(tl.int64) * stride_kt + kvh * stride_kh
        v_rows = v_ptr + q_start.to(tl.int64) * stride_vt + kvh * stride_vh
        acc, m_i, l_i = _attend_new_keys(acc, m_i, l_i, q, tok, 0, m0, qk_scale, cap, k_rows, v_rows,
                                         stride_kt, stride_vt, HEAD, HEAD_PAD, BLOCK_N, False, DOT_DTYPE, SOFTCAP)
        acc, m_i, l_i = _attend_new_keys(acc, m_i, l_i, q, tok, m0, diagonal_end, qk_scale, cap,
                                         k_rows, v_rows, stride_kt, stride_vt, HEAD, HEAD_PAD, BLOCK_N, True,
                                         DOT_DTYPE, SOFTCAP)

    inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
    o = acc * inv[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=qmask)


def takes(call: AttentionCall, decode: bool) -> bool:
    """Whether :func:`new_token_prefill` serves ``call`` (see the module docstring)."""
    # ``==``, not KVQuantMode(...): a mixed format's KVFormat (or its code) is no mode, and is declined.
    return (call.key is not None and call.value is not None and not decode
            and call.kv_quant_mode == KVQuantMode.NONE and call.sliding_window is None
            and call.query.dtype in (torch.bfloat16, torch.float16) and call.kv_cache.dtype == call.query.dtype)


def descriptors(call: AttentionCall, cfg: Tile, head_size: int):
    """Tensor descriptors of the query, key and value as ``[tokens, heads * head_size]`` row-major
    views (blocks of ``BLOCK_M`` / ``BLOCK_N`` rows by one head), or None when ``cfg`` does not ask
    for them or a tensor's layout rules them out: heads not adjacent within a row (a head-major
    query), a row stride or base address that is not a multiple of 16 bytes (what the Hopper
    tensor memory accelerator requires), a head size that is not a power of two (a block
    dimension must be one), or no tokens at all."""
    if not cfg.TMA or head_size & (head_size - 1) or head_size < 16 or call.query.shape[0] == 0:
        return None
    tensors = (call.query, call.key, call.value)
    for t in tensors:
        if (t.stride(2) != 1 or t.stride(1) != head_size or (t.stride(0) * t.element_size()) % 16
                or t.data_ptr() % 16):
            return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return tuple(TensorDescriptor(t, [t.shape[0], t.shape[1] * head_size], [t.stride(0), 1], [rows, head_size])
                 for t, rows in zip(tensors, (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_N)))


def new_token_prefill(call: AttentionCall, tiles: TileTable) -> torch.Tensor:
    """Launch :func:`_new_token_prefill_kernel` for ``call`` (:func:`takes` must hold)."""
    query, kv_cache, key, value = call.query, call.kv_cache, call.key, call.value
    interpret = envs.settings().triton_interpret
    num_tokens, num_q_heads, head_size = query.shape
    num_seqs = call.block_table.shape[0]
    page, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    head_pad = max(16, _next_pow2(head_size))
    cfg: Tile = tiles.interpret if interpret else tiles.new_tokens["small" if head_size <= 128 else "large"]
    if cfg.BLOCK_M % cfg.BLOCK_N:
        raise ValueError(f"new-token prefill tile {cfg}: BLOCK_M must be a multiple of BLOCK_N")
    row_align = _row_align(kv_cache.stride()[:4])
    # Contiguous whatever the query's layout, as the op's fake says; rows outside query_start_loc
    # (padding) read as zeros.
    out = torch.zeros_like(query, memory_format=torch.contiguous_format)
    softcap = float(call.logit_softcap) > 0
    cap = float(call.logit_softcap) * _LOG2E if softcap else 1.0
    grid = (num_tokens // cfg.BLOCK_M + num_seqs, num_q_heads)
    descs = descriptors(call, cfg, head_size)
    _new_token_prefill_kernel[grid](
        query, key, value, *(descs or (query, key, value)), kv_cache, call.block_table, call.seq_lens, call.query_start_loc,
        call.sinks if call.sinks is not None else call.k_scale,  # never read without HAS_SINKS
        out, float(call.sm_scale) * _LOG2E, cap, num_seqs,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        call.block_table.stride(0), out.stride(0), out.stride(1),
        HEAD=head_size, HEAD_PAD=head_pad, GROUP=num_q_heads // num_kv_heads, BLOCK_M=cfg.BLOCK_M,
        BLOCK_N=cfg.BLOCK_N, PAGE=page, DOT_DTYPE=tl.float32 if interpret else tl.float16 if query.dtype ==
        torch.float16 else tl.bfloat16, ROW_ALIGN=row_align, SOFTCAP=softcap, HAS_SINKS=call.sinks is not None,
        PREFETCH_PAGES=cfg.PREFETCH_PAGES, LONGEST_FIRST=cfg.LONGEST_FIRST, TMA=descs is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.MAXNREG} if cfg.MAXNREG and not interpret else {}),
    )
    return out
