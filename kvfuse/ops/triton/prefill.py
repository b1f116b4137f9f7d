"""Prefill attention that reads the new tokens' keys and values from the step's own K/V tensors.

A prompt (or a prompt chunk) writes its K/V into the cache and then attends to them. For a cache
that stores the model dtype (bf16 / fp16, ``KVQuantMode.NONE``) the rows just written are equal
to the ``key`` / ``value`` tensors the write consumed, so those newest ``q_len`` keys of every
sequence can be read from the contiguous tensors (no block-table lookup, no page gather), and
only the cached prefix from the pages.

The prefix is read densely too where that fits (:data:`WHOLE_CONTEXT_MAX_BYTES`): a tensor
descriptor cannot span the pages a block table scatters, and reading the pages inside the kernel
takes per-element addresses (and, tried, a descriptor per quarter tile made the score dots too
small to pay: BENCHMARKS.md), so the prefix is first copied into dense tensors by
:func:`gather_context` (a memory-bound pass over the prefix, a fraction of the attention's time)
and read through descriptors like the new keys (``DENSE_PREFIX``). Sequence ``b``'s position
``j`` sits at row ``b * stride + j``, the stride being the block table's capacity rounded up to
128 (:func:`context_stride`): its size is known without reading ``seq_lens`` on the host, which
also bounds what the gather may allocate, so engines that pass block tables much wider than
their batch's longest sequence take the per-element page reads instead.

A program owns ``BLOCK_M`` consecutive query tokens of one sequence and one query head (head
``h`` reads KV head ``h // GROUP``; the group's programs share K/V through L2). With ``P =
seq_len - q_len`` cached positions before the new tokens, query token ``i`` sits at position
``P + i`` and attends to

    prefix keys    0 <= j < P        from the pages (every row sees all of them)
    new keys       0 <= i' <= i      from ``key[q_start + i']`` (causal)

in one base-2 online softmax with fp32 accumulators (the math of
:mod:`kvfuse.ops.triton.attention`; for the new keys the scale is folded into the exponent, see
:func:`_scaled_softmax_update`). New keys below the tile's first token are visible to every
row and run unmasked; only the key tiles that reach into the diagonal block ``[m0, m0 + BLOCK_M)``
are masked (one of ``BLOCK_M`` and ``BLOCK_N`` divides the other, so key tiles never straddle
``m0`` from below unless they start at ``m0 // BLOCK_N * BLOCK_N``).

With ``Tile.TMA`` the query tile and the new K/V tiles are read through tensor descriptors over
the ``[tokens, heads * head_size]`` views (:func:`descriptors`): on Hopper the tensor memory
accelerator copies whole tiles into shared memory, which frees the registers and issue slots
that per-element addresses take, and is what let a 64-token tile with one warpgroup run faster
than the 128-token tile (BENCHMARKS.md, prefill). A tile that crosses the end of its sequence
reads the next sequence's rows (or zeros past the tensor): those keys sit after every real
query of the tile and are masked, those query rows are never stored. Layouts a descriptor cannot
describe fall back to pointer loads, with the same results.

Quantized caches (FP8 e4m3 / e5m2 and NVFP4, scales per tensor or per KV head) take the same
kernel through :func:`cached_new_token_prefill`: their cached bytes are what attention must see,
not the step's model-dtype K/V, so every cached key of each sequence, prefix and new rows alike,
is first gathered from the pages into dense tensors laid out as above (:func:`gather_context`,
``WHOLE_CONTEXT``), and the kernel attends to the prefix as to new keys that every row sees:

- FP8 e4m3: the codes themselves, keys ``[rows, kv_heads * head_size]`` and values transposed
  ``[kv_heads * head_size, rows]`` (FP8 tensor-core dots want both operands K-major). The kernel
  then runs FP8 dots: each query row is scaled to e4m3's range (``448 / max|q_row|``, the row's
  scale folded into its score scale) and P is rounded to e4m3 as ``2^8 p`` (e4m3's normal range
  then covers ``p >= 2^-14``; the denominator sums the same ``2^8 p``, so the factor cancels).
- FP8 e5m2 and NVFP4: values decoded exactly into the model dtype (an e5m2 code is a model-dtype
  value; NVFP4 as ``e2m1 * block scale * 2^-6``, at most 5 significant bits), with the per-tensor
  or per-head scale (and NVFP4's 2^6) folded into the scores and the output.

Where the whole context does not fit :data:`WHOLE_CONTEXT_MAX_BYTES`, only the new rows are
gathered (:func:`gather_new_rows`, a pass over ``q_len`` rows) and the cached prefix is attended
by the paged kernel first, keys ``[0, P)`` only (``PREFIX_ONLY``, fp16 dots), which leaves each
row's normalised output and base-2 log-sum-exp; the new-token kernel starts its online softmax
from that state (``m = lse``, ``l = 1``, ``acc = o``), so the two parts merge exactly as one
softmax would. Sequences without a prefix skip both the prefix program's work and the merge.
(Reading an FP8 prefix from the pages inside the new-token kernel with FP8 dots measured slower
than either: BENCHMARKS.md.)

What it does not take (the launcher in :mod:`.attention` routes those calls to the paged
kernel): per-token-head FP8 and mixed formats, sliding windows, float32 queries and
decode-sized batches.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ... import envs
from ...kv_cache import KVFormat, KVQuantMode, nvfp4_v_scales_swizzled
from ..registry import AttentionCall
from .attention import (
    _LOG2E,
    _MODE_NVFP4,
    Tile,
    TileTable,
    _attend_range,
    _next_pow2,
    _nvfp4_tile,
    _nvfp4_v_scale_row,
    _row_align,
    _softcap,
    _softmax_update,
    _tile_sequence,
    prefix_partials,
)

__all__ = ["new_token_prefill", "takes", "cached_new_token_prefill", "takes_cached"]

# What the new-token kernel reads as the new keys and values (QUANT).
_STEP_KV = tl.constexpr(0)  # the step's model-dtype K/V (a bf16 / fp16 cache)
_FP8_CODES = tl.constexpr(1)  # gathered e4m3 codes, values transposed; FP8 dots
_DECODED = tl.constexpr(2)  # gathered values decoded into the model dtype
#: P is rounded to e4m3 as 2^P_SHIFT * p (see the module docstring); _P_UNIT = 2^P_SHIFT.
_P_SHIFT_BITS = 8
_P_SHIFT = tl.constexpr(float(_P_SHIFT_BITS))
_P_UNIT = tl.constexpr(float(2 ** _P_SHIFT_BITS))
_E4M3_MAX = tl.constexpr(448.0)
# The order the grid dispatches (query tile, query head) programs in (Tile.GRID_ORDER).
_GRID_TILES = tl.constexpr(0)  # each head's tiles together, head after head
_GRID_HEADS = tl.constexpr(1)  # each tile's heads together, tile after tile
_GRID_GROUP = tl.constexpr(2)  # each KV head's group: its tiles' query heads together
_GRID_ORDERS = {"tiles": 0, "heads": 1, "group": 2}
#: The factor each gathered mode's rows carry beyond the cache's scale (NVFP4's decode is
#: e2m1 * block scale * 2^-6; FP8 codes and values are the scaled values themselves).
_GATHERED_FACTOR = {KVQuantMode.FP8_E4M3: 1.0, KVQuantMode.FP8_E5M2: 1.0, KVQuantMode.NVFP4: 64.0}


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
def _row_scaled_softmax_update(s, allowed, m_i, l_i, qk_row, cap, MASKED: tl.constexpr, SOFTCAP: tl.constexpr):
    """:func:`_scaled_softmax_update` for FP8 dots: row ``i`` of the scores carries its own scale
    ``qk_row[i] > 0`` (the query row's quantization scale folded in), and P comes out as
    ``2^_P_SHIFT * p`` (``m`` stays the true maximum; ``l`` sums the shifted P)."""
    if SOFTCAP or MASKED:
        s = _softcap(s * qk_row[:, None], cap, SOFTCAP)
        if MASKED:
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - (m_use - _P_SHIFT)[:, None])
        alpha = tl.math.exp2(m_i - m_use)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_row)
        p = tl.math.exp2(s * qk_row[:, None] - (m_new - _P_SHIFT)[:, None])
        alpha = tl.math.exp2(m_i - m_new)
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def _to_e4m3(x, PREROUND: tl.constexpr):
    """float32 ``x`` (``|x| <= 448``) to e4m3, rounding to nearest even. PREROUND (under the CPU
    interpreter, whose float32 -> e4m3 conversion drops the carry when rounding crosses a power of
    two, e.g. 31.4 -> 16): round to 3 mantissa bits in integer arithmetic first, which leaves
    normal values exactly representable."""
    if PREROUND:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
        x = bits.to(tl.float32, bitcast=True)
    return x.to(tl.float8e4nv)


@triton.jit
def _new_keys_softmax(s, allowed, m_i, l_i, qk_scale, cap, MASKED: tl.constexpr, SOFTCAP: tl.constexpr,
                      QUANT: tl.constexpr, PREROUND: tl.constexpr):
    """The softmax update of one key tile's scores ``s``: (P in the dtype it meets V in, alpha, m, l)."""
    if QUANT == _FP8_CODES:
        p, alpha, m_i, l_i = _row_scaled_softmax_update(s, allowed, m_i, l_i, qk_scale, cap, MASKED, SOFTCAP)
        p = _to_e4m3(p, PREROUND)
    else:
        p, alpha, m_i, l_i = _scaled_softmax_update(s, allowed, m_i, l_i, qk_scale, cap, MASKED, SOFTCAP)
    return p, alpha, m_i, l_i


@triton.jit
def _values_dot(p, v, acc, BLOCK_N: tl.constexpr, QUANT: tl.constexpr):
    """acc + p @ v. With FP8 codes (e4m3 dots) the tile's product is summed apart and added to acc in
    fp32: Hopper's e4m3 products accumulate with fewer bits than fp32, and summed into acc across
    a long context they shrink O by several percent (BENCHMARKS.md, twenty-seventh session)."""
    if QUANT == _FP8_CODES:
        return tl.dot(p, v, acc, max_num_imprecise_acc=BLOCK_N)
    else:
        return tl.dot(p, v, acc)


@triton.jit
def _attend_new_keys(
    acc, m_i, l_i, q, tok, lo, hi, qk_scale, cap, k_rows, v_rows, stride_kt, stride_vt, stride_vd,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    DOT_DTYPE: tl.constexpr, SOFTCAP: tl.constexpr, QUANT: tl.constexpr, PREROUND: tl.constexpr,
):
    """New keys ``[lo, hi)`` (indices into the sequence's new tokens) for query tokens ``tok``.

    MASKED: the diagonal block (causality, and ``hi`` inside the last tile); unmasked ranges are
    whole tiles that every row sees, loaded without masks. Value element ``(j, d)`` is at
    ``v_rows + j * stride_vt + d * stride_vd`` (transposed values: ``stride_vt`` 1, ``v_rows`` at the
    sequence's column)."""
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
            v = tl.load(v_rows + j[:, None].to(tl.int64) * stride_vt + offs_d[None, :] * stride_vd,
                        mask=tl.trans(lmask), other=0.0)
        else:
            k = tl.load(k_rows + j[None, :].to(tl.int64) * stride_kt + offs_d[:, None])
            v = tl.load(v_rows + j[:, None].to(tl.int64) * stride_vt + offs_d[None, :] * stride_vd)
        s = tl.dot(q, k.to(DOT_DTYPE))
        allowed = kmask[None, :] & (j[None, :] <= tok[:, None])
        p, alpha, m_i, l_i = _new_keys_softmax(s, allowed, m_i, l_i, qk_scale, cap, MASKED, SOFTCAP, QUANT,
                                               PREROUND)
        acc = _values_dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None], BLOCK_N, QUANT)
    return acc, m_i, l_i


@triton.jit
def _attend_new_keys_tma(
    acc, m_i, l_i, q, tok, lo, hi, qk_scale, cap, k_desc, v_desc, row0, v_row0, col,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_DTYPE: tl.constexpr, SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr, PREROUND: tl.constexpr,
):
    """:func:`_attend_new_keys` through tensor descriptors: key/value rows ``row0 + [lo, hi)`` at
    column ``col`` of the ``[tokens, heads * head_size]`` views (FP8 codes: values from the
    transposed ``[heads * head_size, columns]`` view, rows ``col``, columns ``v_row0 + [lo, hi)``).
    Rows past the tensor read as zeros; rows past ``hi`` (the next sequence's) are masked like any
    key after the query."""
    for start in range(lo, hi, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        k = k_desc.load([row0 + start, col])
        s = tl.dot(q, k.to(DOT_DTYPE).T)
        j = start + tl.arange(0, BLOCK_N)
        allowed = j[None, :] <= tok[:, None]
        p, alpha, m_i, l_i = _new_keys_softmax(s, allowed, m_i, l_i, qk_scale, cap, MASKED, SOFTCAP, QUANT,
                                               PREROUND)
        if QUANT == _FP8_CODES:
            v = v_desc.load([col, v_row0 + start]).T
        else:
            v = v_desc.load([row0 + start, col])
        acc = _values_dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None], BLOCK_N, QUANT)
    return acc, m_i, l_i


@triton.jit
def _new_token_prefill_kernel(
    q_ptr, k_ptr, v_ptr, q_desc, k_desc, v_desc, pk_desc, pv_desc, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
    sinks_ptr, out_ptr, k_scale_ptr, v_scale_ptr, pout_ptr, plse_ptr,
    qk_scale, cap, value_factor, num_seqs, seq_stride, k_scale_stride_h, v_scale_stride_h,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_vd,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh, stride_pt, stride_ph, stride_lt,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, DOT_DTYPE: tl.constexpr, ROW_ALIGN: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, PREFETCH_PAGES: tl.constexpr, LONGEST_FIRST: tl.constexpr,
    TMA: tl.constexpr, QUANT: tl.constexpr = 0, PREROUND: tl.constexpr = False, Q_REGISTERS: tl.constexpr = False,
    WHOLE_CONTEXT: tl.constexpr = False, DENSE_PREFIX: tl.constexpr = False, GRID_ORDER: tl.constexpr = 0,
):
    """One (query tile, query head): BLOCK_M new tokens of one sequence over its prefix and itself.

    QUANT (:data:`_STEP_KV`, :data:`_FP8_CODES`, :data:`_DECODED`): what ``k_ptr`` / ``v_ptr``
    hold. Quantized caches (the last two) take their prefix from the paged kernel's partial
    output (``pout_ptr`` / ``plse_ptr``), a bf16 / fp16 cache from the pages here, unless
    WHOLE_CONTEXT: then ``k_ptr`` / ``v_ptr`` hold every cached position of each sequence
    (sequence ``b``'s key ``j`` at row, or value column, ``b * seq_stride + j``), and the prefix is
    attended like the new keys below the diagonal. DENSE_PREFIX (a bf16 / fp16 cache, with TMA):
    the prefix's keys and values are read through ``pk_desc`` / ``pv_desc``, sequence ``b``'s
    position ``j`` at row ``b * seq_stride + j`` (:func:`gather_context` with ``prefix_only``)."""
    if GRID_ORDER == _GRID_HEADS:
        tile = tl.program_id(1)
        if LONGEST_FIRST:
            tile = tl.num_programs(1) - 1 - tile
        h = tl.program_id(0)
    elif GRID_ORDER == _GRID_GROUP:
        tile = tl.program_id(1)
        if LONGEST_FIRST:
            tile = tl.num_programs(1) - 1 - tile
        h = tl.program_id(2) * GROUP + tl.program_id(0)
    else:
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

    # l's unit: FP8 dots accumulate 2^_P_SHIFT * p.
    l_unit = 1.0
    v_out = 1.0
    if QUANT == _STEP_KV:
        qk = qk_scale
    else:
        qk = qk_scale * tl.load(k_scale_ptr + kvh * k_scale_stride_h) * value_factor
        v_out = tl.load(v_scale_ptr + kvh * v_scale_stride_h) * value_factor
    if QUANT == _FP8_CODES:
        # Each query row scaled onto e4m3's range; the scale goes into the row's score scale.
        l_unit = _P_UNIT
        qf = q.to(tl.float32)
        amax = tl.max(tl.abs(qf), 1)
        q_mult = tl.where(amax > 0, _E4M3_MAX / amax, 1.0)
        qf = tl.minimum(tl.maximum(qf * q_mult[:, None], -_E4M3_MAX), _E4M3_MAX)
        q = _to_e4m3(qf, PREROUND).to(DOT_DTYPE)
        qk = qk / q_mult
    else:
        q = q.to(DOT_DTYPE)
        if Q_REGISTERS:
            # Exact for every value (-0 becomes +0, which no dot tells apart). A query tile that
            # is computed rather than loaded is what Triton's Hopper lowering keeps in registers
            # as wgmma's A operand; a loaded one it re-reads from shared memory for every key
            # tile (see Tile.Q_REGISTERS).
            q = q + 0.0

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        # The sink: a virtual key of value zero that seeds the running max and denominator.
        sink = tl.load(sinks_ptr + h + tok * 0) * 1.4426950408889634
        m_i = sink
        l_i = tl.where(sink == float("-inf"), 0.0, l_unit)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)

    if QUANT == _STEP_KV and DENSE_PREFIX:
        # The cached prefix, gathered: whole tiles unmasked, then the partial one (its keys past
        # the prefix are zeros, masked like keys after a query).
        whole = prefix // BLOCK_N * BLOCK_N
        last = prefix - 1 + tok * 0
        acc, m_i, l_i = _attend_new_keys_tma(acc, m_i, l_i, q, last, 0, whole, qk, cap, pk_desc, pv_desc,
                                             b * seq_stride, b * seq_stride, kvh * HEAD, BLOCK_N, False, DOT_DTYPE,
                                             SOFTCAP, QUANT, PREROUND)
        acc, m_i, l_i = _attend_new_keys_tma(acc, m_i, l_i, q, last, whole, prefix, qk, cap, pk_desc, pv_desc,
                                             b * seq_stride, b * seq_stride, kvh * HEAD, BLOCK_N, True, DOT_DTYPE,
                                             SOFTCAP, QUANT, PREROUND)
    elif QUANT == _STEP_KV:
        # The cached prefix, from the pages: whole tiles unmasked, then the partial one masked.
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        qpos = prefix + tok
        whole = prefix // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, qpos, 0, whole, 0, qk, cap, cache_ptr, bt_row, kvh, stride_cb, stride_ckv,
            stride_cs, stride_ch, HEAD, HEAD_PAD, BLOCK_N, PAGE, False, False, DOT_DTYPE, "tf32", ROW_ALIGN,
            False, SOFTCAP, False, PREFETCH_PAGES)
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, qpos, whole, prefix, 0, qk, cap, cache_ptr, bt_row, kvh, stride_cb, stride_ckv,
            stride_cs, stride_ch, HEAD, HEAD_PAD, BLOCK_N, PAGE, True, False, DOT_DTYPE, "tf32", ROW_ALIGN,
            False, SOFTCAP, False, False)
    elif prefix > 0 and not WHOLE_CONTEXT:
        # The paged kernel's state after the prefix (the sink included): m = lse, l = 1, acc = o.
        lse = tl.load(plse_ptr + rows * stride_lt + h, mask=row_ok, other=float("-inf"))
        o_prefix = tl.load(pout_ptr + rows[:, None] * stride_pt + h * stride_ph + offs_d[None, :], mask=qmask,
                           other=0.0)
        seen = lse > float("-inf")
        m_i = lse
        l_i = tl.where(seen, l_unit, 0.0)
        acc = tl.where(seen[:, None], o_prefix * (l_unit / v_out), 0.0)

    # The new tokens, from the step's K/V: every row sees [0, m0); the key tiles that reach into
    # [m0, m0 + BLOCK_M) are masked (a key tile longer than the query tile starts below m0).
    # With the whole context, key j of the sequence is at row key_row0 + j and query token i at
    # key position prefix + i; else the keys start at the sequence's first new token.
    if WHOLE_CONTEXT:
        key_row0 = b * seq_stride
        v_row0 = key_row0
        first = prefix
    else:
        key_row0 = q_start
        v_row0 = q_start
        if QUANT == _FP8_CODES:
            v_row0 = _value_column(q_start, b)
        first = 0
    key_tok = first + tok
    diagonal_start = (first + m0) // BLOCK_N * BLOCK_N
    diagonal_end = first + tl.minimum(m0 + BLOCK_M, q_len)
    if TMA:
        acc, m_i, l_i = _attend_new_keys_tma(acc, m_i, l_i, q, key_tok, 0, diagonal_start, qk, cap, k_desc, v_desc,
                                             key_row0, v_row0, kvh * HEAD, BLOCK_N, False, DOT_DTYPE, SOFTCAP, QUANT,
                                             PREROUND)
        acc, m_i, l_i = _attend_new_keys_tma(acc, m_i, l_i, q, key_tok, diagonal_start, diagonal_end, qk, cap, k_desc,
                                             v_desc, key_row0, v_row0, kvh * HEAD, BLOCK_N, True, DOT_DTYPE, SOFTCAP,
                                             QUANT, PREROUND)
    else:
        k_rows = k_ptr + key_row0.to(tl.int64) * stride_kt + kvh * stride_kh
        v_rows = v_ptr + v_row0.to(tl.int64) * stride_vt + kvh * stride_vh
        acc, m_i, l_i = _attend_new_keys(acc, m_i, l_i, q, key_tok, 0, diagonal_start, qk, cap, k_rows, v_rows,
                                         stride_kt, stride_vt, stride_vd, HEAD, HEAD_PAD, BLOCK_N, False, DOT_DTYPE,
                                         SOFTCAP, QUANT, PREROUND)
        acc, m_i, l_i = _attend_new_keys(acc, m_i, l_i, q, key_tok, diagonal_start, diagonal_end, qk, cap,
                                         k_rows, v_rows, stride_kt, stride_vt, stride_vd, HEAD, HEAD_PAD, BLOCK_N,
                                         True, DOT_DTYPE, SOFTCAP, QUANT, PREROUND)

    inv = tl.where(l_i > 0, v_out / tl.where(l_i > 0, l_i, 1.0), 0.0)
    o = acc * inv[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def _permuted_value_column(col):
    """:func:`permuted_value_column` in a kernel."""
    a = col & 15
    return (col & ~15) + ((a >> 1) & 3) * 4 + (a >> 3) * 2 + (a & 1)


def permuted_value_column(col: int) -> int:
    """Where the native FP8 prefill kernel (csrc/cuda/prefill_attention.cu) wants the value of
    key column ``col``: within each 16 columns, key ``8u + 2t + e`` (u, e in {0, 1}, t < 4) at
    ``4t + 2u + e``. Its P operand of a 32-key product holds, per lane quad position t, the
    accumulator's columns 2t, 2t + 1, 8 + 2t, 9 + 2t (and 16 more) where e4m3's A operand layout
    expects columns 4t .. 4t + 3: the values follow P's order instead of P being shuffled."""
    a = col & 15
    return (col & ~15) + ((a >> 1) & 3) * 4 + (a >> 3) * 2 + (a & 1)


@triton.jit
def _value_column(q_start, b):
    """First column of sequence ``b``'s values in the transposed FP8 value tensor: 16-aligned (a
    tensor descriptor's innermost block offset must be a multiple of 16 bytes), with a gap of at
    least one column before the next sequence's (:func:`value_columns`)."""
    return q_start // 16 * 16 + 16 * b


def value_columns(num_tokens: int, num_seqs: int) -> int:
    """Columns of the transposed FP8 value tensor (:func:`_value_column` of a past-the-end sequence),
    a multiple of 16."""
    return (num_tokens // 16 + num_seqs + 1) * 16


@triton.jit
def _gather_new_rows_kernel(
    cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, k_out_ptr, v_out_ptr, num_seqs, num_tokens, top_bit,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_bt, stride_kt, stride_vt, stride_vd,
    MODE: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_T: tl.constexpr, PAGE: tl.constexpr,
    USE_ASM: tl.constexpr, SWIZZLE_V: tl.constexpr, V_COLUMNS: tl.constexpr, WHOLE_CONTEXT: tl.constexpr = False,
    PREFIX_ONLY: tl.constexpr = False, PERMUTE_VALUES: tl.constexpr = False,
):
    """Rows ``[BLOCK_T * pid0, +BLOCK_T)`` of the call's query, KV head ``pid1``: the cached K/V of
    each row's own position, into ``k_out[row, head * HEAD + d]`` and ``v_out`` at ``row *
    stride_vt + (head * HEAD + d) * stride_vd`` (V_COLUMNS: at column :func:`_value_column` + the
    row's index in its sequence instead of ``row``). Rows outside every sequence (padding, or
    metadata with fewer cached positions than new tokens) get zeros, so a tile that reads past
    its sequence's end meets finite values (V_COLUMNS: the caller zero-fills).

    MODE FP8 e4m3: the codes as stored; e5m2: converted to the output's dtype (exact); NVFP4:
    ``e2m1 * block scale * 2^-6`` (exact, :func:`~kvfuse.ops.triton.attention._nvfp4_tile`).

    WHOLE_CONTEXT: every cached position of sequence ``pid2`` instead, position ``pos`` at row (and
    value column) ``pid2 * num_tokens + pos`` (``num_tokens`` is then the per-sequence stride, a
    multiple of 128); positions from the sequence's length up to the next multiple of 128 get
    zeros (the last key tile reads them), the rest of the stride is not written. PREFIX_ONLY:
    the same for the cached positions before the sequence's new tokens. PERMUTE_VALUES (V_COLUMNS
    with WHOLE_CONTEXT): each value goes to column :func:`permuted_value_column` of its own, the
    order the native FP8 prefill kernel's P operand takes its keys in."""
    kvh = tl.program_id(1)
    if WHOLE_CONTEXT:
        b_seq = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + b_seq)
        if PREFIX_ONLY:
            seq_len -= tl.load(qsl_ptr + b_seq + 1) - tl.load(qsl_ptr + b_seq)
        if tl.program_id(0) * BLOCK_T >= (seq_len + 127) // 128 * 128:
            return
        pos = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        b = b_seq + pos * 0
        in_range = pos < num_tokens
        valid = (pos < seq_len) & in_range
        r = b_seq.to(tl.int64) * num_tokens + pos
    else:
        r = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        in_range = r < num_tokens
        # The row's sequence: the last b with qsl[b] <= r (binary lifting over query_start_loc).
        b = tl.zeros([BLOCK_T], tl.int32)
        bit = top_bit
        while bit > 0:
            cand = b + bit
            first = tl.load(qsl_ptr + cand, mask=cand < num_seqs, other=2147483647)
            b = tl.where(first <= r, cand, b)
            bit = bit // 2
        q_start = tl.load(qsl_ptr + b)
        q_end = tl.load(qsl_ptr + b + 1)
        prefix = tl.load(seq_lens_ptr + b) - (q_end - q_start)
        pos = prefix + (r - q_start)
        valid = in_range & (r >= q_start) & (r < q_end) & (prefix >= 0)
    blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + pos // PAGE, mask=valid, other=0).to(tl.int64)
    t = pos % PAGE
    rows = r.to(tl.int64)
    if MODE == _MODE_NVFP4:
        HALF: tl.constexpr = HEAD // 2
        HALF_PAD: tl.constexpr = HEAD_PAD // 2
        NB: tl.constexpr = HEAD // 16
        num_kv_heads = tl.num_programs(1)
        page = blk * stride_cb
        scales_at = PAGE * HALF * num_kv_heads.to(tl.int64)
        hs = num_kv_heads * NB
        row = (t * num_kv_heads + kvh).to(tl.int64)
        k_data = cache_ptr + page + row * HALF
        k_lo, k_hi = _nvfp4_tile(k_data, cache_ptr, page + scales_at + row * NB, hs, valid, HALF, HALF_PAD, NB,
                                 BLOCK_T, False, True, USE_ASM, False, False)
        v_row = _nvfp4_v_scale_row(t, kvh, row, num_kv_heads, NB, SWIZZLE_V)
        v_lo, v_hi = _nvfp4_tile(k_data + stride_ckv, cache_ptr, stride_ckv + page + scales_at + v_row, hs, valid,
                                 HALF, HALF_PAD, NB, BLOCK_T, False, True, USE_ASM, SWIZZLE_V, False)
        # Even and odd elements interleaved in registers, so that each row is one contiguous store
        # (two stores at a stride of two elements made the gather the prefill's bottleneck).
        ty = k_out_ptr.dtype.element_ty
        offs_d = tl.arange(0, HEAD_PAD)
        smask = in_range[:, None] & (offs_d[None, :] < HEAD)
        k = tl.reshape(tl.join(k_lo.to(ty), k_hi.to(ty)), (BLOCK_T, HEAD_PAD))
        v = tl.reshape(tl.join(v_lo.to(ty), v_hi.to(ty)), (BLOCK_T, HEAD_PAD))
        tl.store(k_out_ptr + rows[:, None] * stride_kt + kvh * HEAD + offs_d[None, :], k, mask=smask)
        tl.store(v_out_ptr + rows[:, None] * stride_vt + (kvh * HEAD + offs_d[None, :]) * stride_vd, v, mask=smask)
    else:
        offs_d = tl.arange(0, HEAD_PAD)
        dmask = offs_d[None, :] < HEAD
        off = blk * stride_cb + t.to(tl.int64) * stride_cs + kvh * stride_ch
        k = tl.load(cache_ptr + off[:, None] + offs_d[None, :], mask=valid[:, None] & dmask, other=0.0)
        v = tl.load(cache_ptr + stride_ckv + off[:, None] + offs_d[None, :], mask=valid[:, None] & dmask, other=0.0)
        smask = in_range[:, None] & dmask
        ty = k_out_ptr.dtype.element_ty
        tl.store(k_out_ptr + rows[:, None] * stride_kt + kvh * HEAD + offs_d[None, :], k.to(ty), mask=smask)
        v_col = rows
        v_mask = smask
        if V_COLUMNS and not WHOLE_CONTEXT:
            # Each sequence's values from its own aligned column; other columns keep their zeros.
            v_col = (r - q_start + _value_column(q_start, b)).to(tl.int64)
            v_mask = valid[:, None] & dmask
        if PERMUTE_VALUES:
            v_col = _permuted_value_column(v_col)
        tl.store(v_out_ptr + v_col[:, None] * stride_vt + (kvh * HEAD + offs_d[None, :]) * stride_vd, v.to(ty),
                 mask=v_mask)


def takes(call: AttentionCall, decode: bool) -> bool:
    """Whether :func:`new_token_prefill` serves ``call`` (see the module docstring)."""
    # ``==``, not KVQuantMode(...): a mixed format's KVFormat (or its code) is no mode, and is declined.
    return (call.key is not None and call.value is not None and not decode
            and call.kv_quant_mode == KVQuantMode.NONE and call.sliding_window is None
            and call.query.dtype in (torch.bfloat16, torch.float16) and call.kv_cache.dtype == call.query.dtype)


def takes_cached(call: AttentionCall, decode: bool) -> bool:
    """Whether :func:`cached_new_token_prefill` serves ``call``: a prefill-sized call without a
    sliding window over an FP8 e4m3 / e5m2 or NVFP4 cache (one mode for K and V), a bf16 / fp16
    query, and a head size the gathered tiles can hold (a multiple of 16, at most 256)."""
    fmt = KVFormat.of(call.kv_quant_mode)
    head_size = call.query.shape[2]
    return (not decode and not fmt.is_mixed and fmt.key in (KVQuantMode.FP8_E4M3, KVQuantMode.FP8_E5M2,
                                                              KVQuantMode.NVFP4)
            and call.sliding_window is None and call.query.dtype in (torch.bfloat16, torch.float16)
            and head_size % 16 == 0 and head_size <= 256)


def _descriptor(t: torch.Tensor, shape, block):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(shape), [t.stride(0), 1], list(block))


def descriptors(call: AttentionCall, cfg: Tile, head_size: int, key: Optional[torch.Tensor] = None,
                value: Optional[torch.Tensor] = None, values_transposed: bool = False):
    """Tensor descriptors of the query, key and value as ``[tokens, heads * head_size]`` row-major
    views (blocks of ``BLOCK_M`` / ``BLOCK_N`` rows by one head), or None when ``cfg`` does not ask
    for them or a tensor's layout rules them out: heads not adjacent within a row (a head-major
    query), a row stride or base address that is not a multiple of 16 bytes (what the Hopper
    tensor memory accelerator requires), a head size that is not a power of two (a block
    dimension must be one), or no tokens at all.

    ``key`` / ``value``: dense tensors in place of the call's step K/V (gathered rows);
    ``values_transposed``: ``value`` is ``[heads * head_size, >= tokens]`` (FP8 codes), described
    as blocks of one head by ``BLOCK_N`` tokens."""
    key = call.key if key is None else key
    value = call.value if value is None else value
    if not cfg.TMA or head_size & (head_size - 1) or head_size < 16 or call.query.shape[0] == 0:
        return None
    row_major = (call.query, key) if values_transposed else (call.query, key, value)
    for t in row_major:
        if (t.stride(2) != 1 or t.stride(1) != head_size or (t.stride(0) * t.element_size()) % 16
                or t.data_ptr() % 16):
            return None
    if values_transposed and ((value.stride(0) * value.element_size()) % 16 or value.stride(1) != 1
                              or value.data_ptr() % 16):
        return None
    descs = [_descriptor(t, [t.shape[0], t.shape[1] * head_size], [rows, head_size])
             for t, rows in zip(row_major, (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_N))]
    if values_transposed:
        descs.append(_descriptor(value, value.shape, [head_size, cfg.BLOCK_N]))
    return tuple(descs)


def _tile(tiles: TileTable, head_size: int, fp8_dots: bool, interpret: bool) -> Tile:
    """The new-token tile: ``small`` / ``large`` by head size, ``<size>_fp8`` for FP8 dots where
    the table has one."""
    if interpret:
        return tiles.interpret
    size = "small" if head_size <= 128 else "large"
    cfg = tiles.new_tokens.get(f"{size}_fp8", tiles.new_tokens[size]) if fp8_dots else tiles.new_tokens[size]
    if cfg.BLOCK_M % cfg.BLOCK_N and cfg.BLOCK_N % cfg.BLOCK_M:
        raise ValueError(f"new-token prefill tile {cfg}: one of BLOCK_M and BLOCK_N must divide the other")
    if fp8_dots and cfg.BLOCK_N < 32:
        raise ValueError(f"new-token prefill tile {cfg}: FP8 dots need BLOCK_N >= 32 (P @ V's reduction)")
    return cfg


@functools.lru_cache(maxsize=None)
def _l2_bytes(device_index: int) -> int:
    return int(getattr(torch.cuda.get_device_properties(device_index), "L2_cache_size", 0))


def grid_order_for(cfg: Tile, query: torch.Tensor, key: torch.Tensor, num_kv_heads: int, interpret: bool) -> str:
    """``cfg.GRID_ORDER``, with ``auto`` resolved: ``heads`` (every head's longest query tile
    first, which evens out the causal tail) while the new tokens' K/V of all heads take at most
    half the GPU's L2, else ``tiles`` (one head's tiles together, so the K/V in use is one KV
    head's). With the K/V of every head in flight at once, a larger context stops fitting in L2
    and is read from memory again (BENCHMARKS.md, prefill grid orders)."""
    if cfg.GRID_ORDER != "auto":
        return cfg.GRID_ORDER
    if interpret:
        return "tiles"
    return device_grid_order(query, key.element_size(), num_kv_heads)


def device_grid_order(query: torch.Tensor, kv_element_size: int, num_kv_heads: int) -> str:
    """:func:`auto_grid_order` for ``query``'s tokens with K/V elements of ``kv_element_size``
    bytes, against the L2 of ``query``'s device (``tiles`` off CUDA)."""
    if query.device.type != "cuda":
        return "tiles"
    index = query.device.index if query.device.index is not None else torch.cuda.current_device()
    return auto_grid_order(2 * query.shape[0] * num_kv_heads * query.shape[2] * kv_element_size, _l2_bytes(index))


def auto_grid_order(kv_bytes: int, l2_bytes: int) -> str:
    """The ``auto`` rule of :func:`grid_order_for`: ``heads`` while ``kv_bytes`` (the new
    tokens' K and V, all heads) is at most half of ``l2_bytes``, else ``tiles``."""
    return "heads" if 2 * kv_bytes <= l2_bytes else "tiles"


def _launch(call: AttentionCall, cfg: Tile, key: torch.Tensor, value: torch.Tensor, quant: int,
            values_transposed: bool = False, value_factor: float = 1.0, partials=None,
            seq_stride: Optional[int] = None, prefix_descs=None, descs=None) -> torch.Tensor:
    """Launch :func:`_new_token_prefill_kernel` with new keys / values ``key`` / ``value`` (with
    ``seq_stride``: every cached key of each sequence, laid out as :func:`gather_context` does, or
    with ``prefix_descs`` the descriptors of the gathered prefix that :func:`new_token_prefill`
    makes; ``descs``: the query / key / value descriptors where the caller has made them)."""
    query, kv_cache = call.query, call.kv_cache
    interpret = envs.settings().triton_interpret
    num_tokens, num_q_heads, head_size = query.shape
    num_seqs = call.block_table.shape[0]
    page, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    fp8_dots = quant == int(_FP8_CODES)
    head_pad = max(32 if fp8_dots else 16, _next_pow2(head_size))
    row_align = _row_align(kv_cache.stride()[:4])
    # Contiguous whatever the query's layout, as the op's fake says; rows outside query_start_loc
    # (padding) read as zeros.
    out = torch.zeros_like(query, memory_format=torch.contiguous_format)
    softcap = float(call.logit_softcap) > 0
    cap = float(call.logit_softcap) * _LOG2E if softcap else 1.0
    tiles_of_rows = num_tokens // cfg.BLOCK_M + num_seqs
    grid_order = _GRID_ORDERS[grid_order_for(cfg, query, key, num_kv_heads, interpret)]
    if grid_order == _GRID_HEADS:
        grid = (num_q_heads, tiles_of_rows)
    elif grid_order == _GRID_GROUP:
        grid = (num_q_heads // num_kv_heads, tiles_of_rows, num_kv_heads)
    else:
        grid = (tiles_of_rows, num_q_heads)
    if descs is None and head_pad == head_size:
        descs = descriptors(call, cfg, head_size, key, value, values_transposed)
    if interpret:
        dot_dtype = tl.float32
    elif fp8_dots:
        dot_dtype = tl.float8e4nv
    else:
        dot_dtype = tl.float16 if query.dtype == torch.float16 else tl.bfloat16
    if values_transposed:
        # value is [kv_heads * head_size, tokens (padded)]: (token, head, element) strides.
        v_strides = (1, head_size * value.stride(0), value.stride(0))
    else:
        v_strides = (value.stride(0), value.stride(1), 1)
    pout, plse = partials if partials is not None else (out, out)
    k_scale, v_scale = call.k_scale, call.v_scale
    _new_token_prefill_kernel[grid](
        query, key, value, *(descs or (query, key, value)), *(prefix_descs or (query, query)), kv_cache,
        call.block_table, call.seq_lens,
        call.query_start_loc,
        call.sinks if call.sinks is not None else k_scale,  # never read without HAS_SINKS
        out, k_scale, v_scale, pout, plse,
        float(call.sm_scale) * _LOG2E, cap, value_factor, num_seqs, seq_stride or 0,
        k_scale.stride(0) if k_scale.numel() > 1 else 0, v_scale.stride(0) if v_scale.numel() > 1 else 0,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), *v_strides,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        call.block_table.stride(0), out.stride(0), out.stride(1),
        pout.stride(0), pout.stride(1), plse.stride(0) if partials is not None else 0,
        HEAD=head_size, HEAD_PAD=head_pad, GROUP=num_q_heads // num_kv_heads, BLOCK_M=cfg.BLOCK_M,
        BLOCK_N=cfg.BLOCK_N, PAGE=page, DOT_DTYPE=dot_dtype, ROW_ALIGN=row_align, SOFTCAP=softcap,
        HAS_SINKS=call.sinks is not None, PREFETCH_PAGES=cfg.PREFETCH_PAGES, LONGEST_FIRST=cfg.LONGEST_FIRST,
        TMA=descs is not None, QUANT=quant, PREROUND=interpret, Q_REGISTERS=cfg.Q_REGISTERS,
        WHOLE_CONTEXT=seq_stride is not None and prefix_descs is None, DENSE_PREFIX=prefix_descs is not None,
        GRID_ORDER=grid_order,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.MAXNREG} if cfg.MAXNREG and not interpret else {}),
    )
    return out


def new_token_prefill(call: AttentionCall, tiles: TileTable, dense_prefix: Optional[bool] = None) -> torch.Tensor:
    """Prefill of a bf16 / fp16 cache's call with the step's K/V (:func:`takes` must hold).

    ``dense_prefix``: gather the cached prefix into dense tensors first and read it through
    tensor descriptors (True), or read it from the pages (False); default: where the query and
    K/V take descriptors and the gather fits :data:`WHOLE_CONTEXT_MAX_BYTES`. Descriptors cannot
    span pages, so per-element page addresses are the alternative (BENCHMARKS.md, prefill)."""
    cfg = _tile(tiles, call.query.shape[2], False, envs.settings().triton_interpret)
    head_size = call.query.shape[2]
    if dense_prefix is None:
        dense_prefix = context_bytes(call, False) <= WHOLE_CONTEXT_MAX_BYTES
    descs = descriptors(call, cfg, head_size)
    if dense_prefix and descs is not None:
        key, value, stride = gather_context(call, False, prefix_only=True)
        block = [cfg.BLOCK_N, head_size]
        prefix_descs = tuple(_descriptor(t, [t.shape[0], t.shape[1] * head_size], block) for t in (key, value))
        return _launch(call, cfg, call.key, call.value, int(_STEP_KV), seq_stride=stride, prefix_descs=prefix_descs,
                       descs=descs)
    return _launch(call, cfg, call.key, call.value, int(_STEP_KV), descs=descs)


#: Rows per program of the gather.
_GATHER_ROWS = 64


def _gather(call: AttentionCall, fp8_codes: bool, inline_asm: bool, rows: int, value_cols: int, zero_values: bool,
            extent: int, top_bit: int, whole_context: bool = False, prefix_only: bool = False,
            permute_values: bool = False):
    """Allocate the gathered tensors (``rows`` key rows; e4m3 values as ``value_cols`` columns,
    zeroed first where the kernel leaves columns a key tile reads, ``zero_values``) and launch
    :func:`_gather_new_rows_kernel` (skipped when there is nothing to gather) over ``extent`` rows
    per KV head, and per sequence with ``whole_context``; ``extent`` / ``top_bit`` are the
    kernel's ``num_tokens`` / ``top_bit``."""
    query, kv_cache = call.query, call.kv_cache
    interpret = envs.settings().triton_interpret
    mode = KVFormat.of(call.kv_quant_mode).key
    head_size = query.shape[2]
    page, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    if fp8_codes:
        if mode is not KVQuantMode.FP8_E4M3:
            raise ValueError(f"kv_quant_mode={mode.name}: only FP8_E4M3 rows are gathered as codes")
        key = torch.empty((rows, num_kv_heads, head_size), dtype=kv_cache.dtype, device=query.device)
        # Zeros where no row is gathered: a value tile that crosses its sequence's end reads them
        # (masked keys, but NaN times a zero weight would still be NaN).
        value = (torch.zeros if zero_values else torch.empty)((num_kv_heads * head_size, value_cols),
                                                              dtype=kv_cache.dtype, device=query.device)
        v_strides = (1, value.stride(0))
    else:
        key = torch.empty((rows, num_kv_heads, head_size), dtype=query.dtype, device=query.device)
        value = torch.empty_like(key)
        v_strides = (value.stride(0), 1)
    num_seqs = call.block_table.shape[0]
    if rows == 0 or num_seqs == 0:
        return key, value
    block_t = 16 if interpret else _GATHER_ROWS
    grid = (triton.cdiv(extent, block_t), num_kv_heads) + ((num_seqs,) if whole_context else ())
    _gather_new_rows_kernel[grid](
        kv_cache, call.block_table, call.seq_lens, call.query_start_loc, key, value, num_seqs, extent, top_bit,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), call.block_table.stride(0),
        key.stride(0), *v_strides,
        MODE=int(mode), HEAD=head_size, HEAD_PAD=max(32, _next_pow2(head_size)), BLOCK_T=block_t, PAGE=page,
        USE_ASM=inline_asm and not interpret,
        SWIZZLE_V=mode is KVQuantMode.NVFP4 and nvfp4_v_scales_swizzled(page, head_size), V_COLUMNS=fp8_codes,
        WHOLE_CONTEXT=whole_context, PREFIX_ONLY=prefix_only, PERMUTE_VALUES=permute_values, num_warps=4,
    )
    return key, value


def gather_new_rows(call: AttentionCall, fp8_codes: bool, inline_asm: bool = True):
    """The cached K/V of every query row's own position, dense (:func:`_gather_new_rows_kernel`):
    ``(key [tokens, kv_heads, head_size], value)``, value ``[kv_heads * head_size,``
    :func:`value_columns` ``]`` of e4m3 codes, each sequence from its :func:`_value_column`, when
    ``fp8_codes``, else ``[tokens, kv_heads, head_size]`` values decoded into the query's dtype
    (without the cache's scales)."""
    num_tokens, num_seqs = call.query.shape[0], call.block_table.shape[0]
    return _gather(call, fp8_codes, inline_asm, num_tokens, value_columns(num_tokens, num_seqs), True, num_tokens,
                   1 << (num_seqs - 1).bit_length() - 1 if num_seqs > 1 else 0)


def context_stride(call: AttentionCall) -> int:
    """Rows per sequence in :func:`gather_context`'s tensors: the block table's capacity rounded
    up to 128 (the longest key tile), so each sequence's rows start 16-byte aligned in the
    transposed FP8 values and its last key tile stays inside its own rows."""
    capacity = call.block_table.shape[1] * call.kv_cache.shape[2]
    return -(-capacity // 128) * 128


def context_bytes(call: AttentionCall, fp8_codes: bool) -> int:
    """Bytes :func:`gather_context` allocates for ``call``."""
    num_seqs, num_kv_heads, head_size = call.block_table.shape[0], call.kv_cache.shape[3], call.query.shape[2]
    element = 1 if fp8_codes else call.query.element_size()
    return 2 * num_seqs * context_stride(call) * num_kv_heads * head_size * element


#: The most bytes the whole-context gather may allocate for one call; larger calls (long block
#: tables, big batches) keep the prefix in the pages and merge the paged kernel's partials.
WHOLE_CONTEXT_MAX_BYTES = 1 << 30


def gather_context(call: AttentionCall, fp8_codes: bool, inline_asm: bool = True, prefix_only: bool = False,
                   permute_values: bool = False):
    """Every cached position of every sequence, dense (:func:`_gather_new_rows_kernel` with
    WHOLE_CONTEXT): ``(key, value, stride)``, sequence ``b``'s position ``j`` at row ``b * stride +
    j`` of ``key [num_seqs * stride, kv_heads, head_size]`` and of ``value`` (same shape, decoded
    into the query's dtype), or at that column of ``value [kv_heads * head_size, num_seqs *
    stride]`` (e4m3 codes, transposed) when ``fp8_codes``. Rows from a sequence's length to the
    next multiple of 128 are zeros; rows past them are not written. ``prefix_only``: the positions
    before each sequence's new tokens only (a bf16 / fp16 cache's prefix, :func:`new_token_prefill`).
    ``permute_values`` (``fp8_codes``): value columns in :func:`permuted_value_column`'s order."""
    if permute_values and not fp8_codes:
        raise ValueError("permute_values applies to e4m3 codes (fp8_codes=True) only")
    stride = context_stride(call)
    rows = call.block_table.shape[0] * stride
    # The kernel writes zeros up to each sequence's last key tile, and no tile reads further.
    key, value = _gather(call, fp8_codes, inline_asm, rows, rows, False, stride, 0, whole_context=True,
                         prefix_only=prefix_only, permute_values=permute_values)
    return key, value, stride


def cached_new_token_prefill(call: AttentionCall, tiles: TileTable, fp8_dots: bool = True, inline_asm: bool = True,
                             quant_dot_fp16: bool = True, whole_context: Optional[bool] = None) -> torch.Tensor:
    """Prefill of a quantized cache's call (:func:`takes_cached` must hold): the whole context
    gathered from the pages and attended by the new-token kernel, or (``whole_context`` False, or
    by default when the gather would exceed :data:`WHOLE_CONTEXT_MAX_BYTES`) the new rows gathered
    and the prefix through the paged kernel (see the module docstring). ``fp8_dots``: FP8 e4m3
    caches take FP8 tensor-core dots (else their rows are decoded like e5m2's); ``inline_asm`` /
    ``quant_dot_fp16``: the paged kernel's options
    (:func:`~kvfuse.ops.triton.attention.paged_attention`), for the gather and the prefix."""
    mode = KVFormat.of(call.kv_quant_mode).key
    codes = fp8_dots and mode is KVQuantMode.FP8_E4M3
    cfg = _tile(tiles, call.query.shape[2], codes, envs.settings().triton_interpret)
    if whole_context is None:
        whole_context = context_bytes(call, codes) <= WHOLE_CONTEXT_MAX_BYTES
    if whole_context:
        key, value, stride = gather_context(call, codes, inline_asm=inline_asm)
        return _launch(call, cfg, key, value, int(_FP8_CODES if codes else _DECODED), values_transposed=codes,
                       value_factor=_GATHERED_FACTOR[mode], seq_stride=stride)
    key, value = gather_new_rows(call, codes, inline_asm=inline_asm)
    partials = prefix_partials(call, tiles, inline_asm=inline_asm, quant_dot_fp16=quant_dot_fp16)
    return _launch(call, cfg, key, value, int(_FP8_CODES if codes else _DECODED), values_transposed=codes,
                   value_factor=_GATHERED_FACTOR[mode], partials=partials)
