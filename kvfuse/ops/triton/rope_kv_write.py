"""Triton kernel for ``kvfuse::rope_encode_and_cache_write``: rotary embedding + encode + paged store.

Reference math (:func:`kvfuse.ops.reference.apply_rope`, then ``encode_and_cache_write``)::

    for every token t, head h, feature i < R (R = rotary_dim; features >= R pass through):
        row   = positions[t] if positions is given else t
        p     = i + R/2 if i < R/2 else i - R/2     (NeoX, rotate-half)  |  i ^ 1     (GPT-J, interleaved)
        sign  = -1 if i < R/2 else +1               (NeoX)               |  -1 if i even else +1
        col   = i, or with half-width tables:  i mod R/2 (NeoX)          |  i // 2
        y[i]  = x[i] * cos[row, col] + (sign * x[p]) * sin[row, col]      # float32
        k_rot = round(y, key.dtype);   cache[slot[t]] <- encode(k_rot), encode(v)  (slot -1: skipped)
        q_out = round(y(query), query.dtype)

One launch does it all: grid ``(token blocks, KV head blocks + query head blocks)``. A KV
program rotates its K rows in registers, rounds them to the key dtype as the unfused graph
stores them, encodes them with the cache format's own code (:func:`.kv_write._store_dense` /
:func:`.kv_write._store_nvfp4`, the same device functions as ``encode_and_cache_write``) and
stores K and V at their slots (NVFP4: split over the page's data and scale regions, as
``encode_and_cache_write`` stores them). A query program rotates its query rows into the
returned tensor. Against ``rotate, then write`` this saves K's write and re-read and, for the
query, one launch; against the write alone it adds the query's read and write (which the model
does anyway) and the cos/sin rows.

Two rotations, one result (``rotation=`` of the launcher; by default, where the split one applies,
the one :mod:`kvfuse.ops.tuning` measured faster for the format and token count, which on the
H100 is the gathered one below 256 tokens for FP8 and NVFP4). Both write the same float32
expression per feature, and where the split form is used they give the same bits
(:func:`split_rotation_applies` says why float32 rows are left out):

- *split* (16-bit rows): each element is loaded once and its partner is another register of the
  same thread. NeoX with ``R == BLOCK_D`` (rotary over the whole, power-of-two, tile): the two halves are
  loaded as two ``[BLOCK_T, BLOCK_H, R/2]`` tiles of one layout, so that thread-for-thread
  ``x1[j]`` and its partner ``x2[j] = x[j + R/2]`` sit together::

      y[:R/2] = x1 * c1 + (-x2) * s1        y[R/2:] = x2 * c2 + x1 * s2

  with ``c1, c2`` (``s1, s2``) the cos (sin) row's halves, or a half-width row for both; casts
  and FP8 store each half where it belongs, NVFP4 and per-token-head encode the halves joined
  back into rows (``tl.join``; the block scales and the row scale span both). GPT-J (any R):
  the row is loaded whole and ``tl.split`` of its ``[.., BLOCK_D/2, 2]`` view gives the (even,
  odd) pairs, adjacent features that one thread already holds; the same formula, joined back,
  with features ``>= R`` passed through unchanged.
- *gather*: the partner of feature ``i`` is a second load ``x[p(i)]`` of the same row (an L1
  hit), and the sign and table column are selected per feature (the formula above). It serves
  what the split form cannot express, NeoX partial rotary and head sizes that are not a power
  of two (``R < BLOCK_D``), and float32 rows, for which the split form's FMA contraction is not
  the gathered form's (:func:`split_rotation_applies`).

The tables are read per (token, head, feature) through pointers broadcast over the heads, so
that they take the rows' layout. A ``[BLOCK_T, 1, R]`` tile, read once per token, was tried: it
got a layout of its own and shuffles through shared memory to meet the rows (sm_90 SASS, bf16
cache at 4096 tokens: 14 barriers where there had been none), and it could not save loads anyway,
since in the launch configurations' tiles each thread holds features of a single head.

Floating-point contraction: the sum is written ``x * cos + rot * sin``, as Inductor writes
``q * cos + rotate_half(q) * sin``; Triton contracts both the same way unless ``fp_fusion=False``
(Inductor passes ``enable_fp_fusion = not emulate_precision_casts`` to its own kernels). On CPU
(the interpreter) nothing is contracted, which is the reference's float32 math.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...kv_cache import KVQuantMode
from .. import tuning
from .kv_write import (_FP8_PTH, _NVFP4, _encode_rows, _head_scale_ptr, _launch_config, _nvfp4_page_layout,
                       _nvfp4_side_bases, _soft_rounding, _store_dense, _store_nvfp4, _store_per_token_head,
                       scale_head_stride)

__all__ = ["rope_encode_and_cache_write"]

_NONE = tl.constexpr(int(KVQuantMode.NONE))


@triton.jit
def _rope_values(src_ptr, row, e, ok, cos_ptr, sin_ptr, cos_row, sin_row, R: tl.constexpr, NEOX: tl.constexpr,
                 HALF_TABLE: tl.constexpr):
    """float32 ``y`` of the rows at ``src_ptr + row`` for features ``e`` (broadcast shapes), unrounded."""
    x = tl.load(src_ptr + row + e, mask=ok, other=0.0).to(tl.float32)
    if NEOX:
        first = e < R // 2
        partner = tl.where(first, e + R // 2, e - R // 2)
        if HALF_TABLE:
            col = tl.where(first, e, e - R // 2)
        else:
            col = e
    else:
        first = (e % 2) == 0
        partner = tl.where(first, e + 1, e - 1)
        if HALF_TABLE:
            col = e // 2
        else:
            col = e
    rot_ok = ok & (e < R)
    xp = tl.load(src_ptr + row + partner, mask=rot_ok, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + cos_row + col, mask=rot_ok, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + sin_row + col, mask=rot_ok, other=0.0).to(tl.float32)
    r = tl.where(first, -xp, xp)
    return tl.where(e < R, x * c + r * s, x)


@triton.jit
def _round_to(y, DTYPE: tl.constexpr, SOFT_ROUNDING: tl.constexpr):
    """``y`` rounded to ``DTYPE`` (nearest even) and widened back to float32."""
    if DTYPE == tl.bfloat16:
        if SOFT_ROUNDING:  # the interpreter truncates float32 -> bfloat16
            b = y.to(tl.uint32, bitcast=True)
            b = tl.where(y != y, b | 0x400000, b + 0x7FFF + ((b >> 16) & 1))
            return (b & 0xFFFF0000).to(tl.float32, bitcast=True)
        else:
            return y.to(tl.bfloat16).to(tl.float32)
    elif DTYPE == tl.float16:
        return y.to(tl.float16).to(tl.float32)
    else:
        return y


@triton.jit
def _rotate_pairs(x1, x2, c1, s1, c2, s2):
    """``(y1, y2)`` of partners ``x1``, ``x2`` (float32, one shape)::

        y1 = x1 * c1 + (-x2) * s1        y2 = x2 * c2 + x1 * s2

    the gathered form's ``x * c + r * s`` term for term (``r = -x[p]`` for the first of a pair,
    ``x[p]`` for the second), so that FMA contraction can fold the same products (it does for
    16-bit rows; float32 ones are left to the gathered form, see :func:`split_rotation_applies`)."""
    return x1 * c1 + (-x2) * s1, x2 * c2 + x1 * s2


@triton.jit
def _neox_halves(src_ptr, row, ok, cos_ptr, sin_ptr, cos_row, sin_row, R: tl.constexpr, HALF_TABLE: tl.constexpr):
    """NeoX rotation of whole rows (``R`` = the head size): float32 ``(y[:R/2], y[R/2:])``, each
    ``[BLOCK_T, BLOCK_H, R/2]``, of the rows at ``src_ptr + row`` (``row``, ``ok``: ``[BLOCK_T, BLOCK_H, 1]``;
    ``cos_row``, ``sin_row``: ``[BLOCK_T, 1, 1]``), unrounded.

    The two halves are loaded as two tiles of one shape, so the same thread holds feature ``i``
    and its partner ``i + R/2``: no second load of the row and no exchange between threads. The
    cos/sin halves are tiles of that shape too (their pointers broadcast over heads, cached
    loads), so that they share the layout; a half-width table's row serves both halves.
    """
    j = tl.arange(0, R // 2)[None, None, :]
    x1 = tl.load(src_ptr + row + j, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + row + R // 2 + j, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + cos_row + j, mask=ok, other=1.0).to(tl.float32)
    s1 = tl.load(sin_ptr + sin_row + j, mask=ok, other=0.0).to(tl.float32)
    if HALF_TABLE:
        c2 = c1
        s2 = s1
    else:
        c2 = tl.load(cos_ptr + cos_row + R // 2 + j, mask=ok, other=1.0).to(tl.float32)
        s2 = tl.load(sin_ptr + sin_row + R // 2 + j, mask=ok, other=0.0).to(tl.float32)
    return _rotate_pairs(x1, x2, c1, s1, c2, s2)


@triton.jit
def _join_halves(y1, y2):
    """The ``[.., 2 * W]`` rows whose first and second halves are ``y1`` and ``y2`` (``[.., W]``, rank 3)."""
    pairs = tl.permute(tl.join(y1, y2), (0, 1, 3, 2))
    return tl.reshape(pairs, (y1.shape[0], y1.shape[1], 2 * y1.shape[2]))


@triton.jit
def _gptj_split_values(src_ptr, row, e, rows_ok, cos_ptr, sin_ptr, cos_row, sin_row, D: tl.constexpr,
                       R: tl.constexpr, HALF_TABLE: tl.constexpr):
    """GPT-J rotation of ``[BLOCK_T, BLOCK_H, W]`` rows (features ``e``, ``[1, 1, W]``; ``rows_ok``
    ``[BLOCK_T, BLOCK_H, 1]``), float32, unrounded: each row is loaded once and its (even, odd)
    pairs, adjacent in one thread's registers, are taken apart with ``tl.split``. A full-width table's row is split the
    same way (its pointers broadcast over heads, so that it shares the rows' layout); a
    half-width table's row ``[.., W/2]`` is column ``i // 2`` for both of a pair. Features
    ``>= R`` pass through."""
    BLOCK_T: tl.constexpr = row.shape[0]
    BLOCK_H: tl.constexpr = row.shape[1]
    W: tl.constexpr = e.shape[2]
    x = tl.load(src_ptr + row + e, mask=rows_ok & (e < D), other=0.0).to(tl.float32)
    x1, x2 = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_H, W // 2, 2)))
    rot_ok = rows_ok & (e < R)
    if HALF_TABLE:
        j = tl.arange(0, W // 2)[None, None, :]
        pair_ok = rows_ok & (j < R // 2)
        c1 = tl.load(cos_ptr + cos_row + j, mask=pair_ok, other=1.0).to(tl.float32)
        s1 = tl.load(sin_ptr + sin_row + j, mask=pair_ok, other=0.0).to(tl.float32)
        c2 = c1
        s2 = s1
    else:
        c = tl.load(cos_ptr + cos_row + e, mask=rot_ok, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + sin_row + e, mask=rot_ok, other=0.0).to(tl.float32)
        c1, c2 = tl.split(tl.reshape(c, (BLOCK_T, BLOCK_H, W // 2, 2)))
        s1, s2 = tl.split(tl.reshape(s, (BLOCK_T, BLOCK_H, W // 2, 2)))
    y1, y2 = _rotate_pairs(x1, x2, c1, s1, c2, s2)
    y = tl.reshape(tl.join(y1, y2), (BLOCK_T, BLOCK_H, W))
    if R < D:
        y = tl.where(e < R, y, x)
    return y


@triton.jit
def _rope_rows(src_ptr, row, rows_ok, cos_ptr, sin_ptr, cos_row, sin_row, D: tl.constexpr, R: tl.constexpr,
               NEOX: tl.constexpr, HALF_TABLE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_D: tl.constexpr):
    """float32 ``y`` of the ``[BLOCK_T, BLOCK_H, BLOCK_D]`` rows at ``src_ptr + row`` (``row``,
    ``rows_ok``: ``[BLOCK_T, BLOCK_H, 1]``; ``cos_row``, ``sin_row``: ``[BLOCK_T, 1, 1]``), unrounded:
    the gathered rotation, or the split one (NeoX: ``BLOCK_D == R``, its halves joined into rows)."""
    e = tl.arange(0, BLOCK_D)[None, None, :]
    if SPLIT:
        if NEOX:
            y1, y2 = _neox_halves(src_ptr, row, rows_ok, cos_ptr, sin_ptr, cos_row, sin_row, R, HALF_TABLE)
            y = _join_halves(y1, y2)
        else:
            y = _gptj_split_values(src_ptr, row, e, rows_ok, cos_ptr, sin_ptr, cos_row, sin_row, D, R, HALF_TABLE)
    else:
        y = _rope_values(src_ptr, row, e, rows_ok & (e < D), cos_ptr, sin_ptr, cos_row, sin_row, R, NEOX, HALF_TABLE)
    return y


@triton.jit
def _rope_encode_rows(src_ptr, dst_ptr, scale_ptr, cos_ptr, sin_ptr, src_tok, dst_tok, cos_tok, sin_tok, tok_ok, h0,
                      H: tl.constexpr, SRC_STRIDE_H: tl.constexpr, DST_STRIDE_H: tl.constexpr, D: tl.constexpr,
                      R: tl.constexpr, NEOX: tl.constexpr, HALF_TABLE: tl.constexpr, MODE: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SOFT_ROUNDING: tl.constexpr, dst_off,
                      PAGE: tl.constexpr, SCALE_STRIDE_H: tl.constexpr, SPLIT: tl.constexpr):
    """Rotate ``[BLOCK_T, BLOCK_H, D]`` of K, round to K's dtype, encode and store the rows (NVFP4:
    ``dst_tok`` is the page side's offset, ``dst_off`` the in-page token; K scales are linear)."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    scale_ptr = _head_scale_ptr(scale_ptr, offs_h, H, SCALE_STRIDE_H)
    row = src_tok[:, None, None] + (offs_h * SRC_STRIDE_H)[None, :, None]
    cos_row = cos_tok[:, None, None]
    sin_row = sin_tok[:, None, None]
    if MODE == _NVFP4:
        BLOCK_NB: tl.constexpr = BLOCK_D // 16
        offs_b = tl.arange(0, BLOCK_NB)
        row_ok = tok_ok[:, None, None] & h_ok[None, :, None] & (offs_b < D // 16)[None, None, :]
        if SPLIT:
            # Rotated as whole rows (a pair may span two 16-blocks), then viewed as the blocks.
            y = _rope_rows(src_ptr, row, tok_ok[:, None, None] & h_ok[None, :, None], cos_ptr, sin_ptr, cos_row,
                           sin_row, D, R, NEOX, HALF_TABLE, True, BLOCK_D)
            y = tl.reshape(y, (y.shape[0], BLOCK_H, BLOCK_NB, 16))
        else:
            e = (offs_b * 16)[None, None, :, None] + tl.arange(0, 16)[None, None, None, :]
            y = _rope_values(src_ptr, row[:, :, :, None], e, row_ok[:, :, :, None], cos_ptr, sin_ptr,
                             cos_row[:, :, :, None], sin_row[:, :, :, None], R, NEOX, HALF_TABLE)
        y = _round_to(y, src_ptr.dtype.element_ty, SOFT_ROUNDING)
        _store_nvfp4(y, dst_ptr, scale_ptr, dst_tok, offs_h, row_ok, DST_STRIDE_H, D, BLOCK_H, BLOCK_D,
                     dst_off, H, True, PAGE, False)
    elif SPLIT and NEOX and MODE != _FP8_PTH:
        # Elementwise encodings store each half where it belongs: the rows are never joined,
        # which would move every value between threads.
        ok = tok_ok[:, None, None] & h_ok[None, :, None]
        y1, y2 = _neox_halves(src_ptr, row, ok, cos_ptr, sin_ptr, cos_row, sin_row, R, HALF_TABLE)
        dst = dst_tok[:, None, None] + (offs_h * DST_STRIDE_H)[None, :, None] + tl.arange(0, R // 2)[None, None, :]
        _store_dense(_round_to(y1, src_ptr.dtype.element_ty, SOFT_ROUNDING), dst_ptr + dst, scale_ptr, ok, MODE,
                     SOFT_ROUNDING)
        _store_dense(_round_to(y2, src_ptr.dtype.element_ty, SOFT_ROUNDING), dst_ptr + dst + R // 2, scale_ptr, ok,
                     MODE, SOFT_ROUNDING)
    else:
        e = tl.arange(0, BLOCK_D)[None, None, :]
        ok = tok_ok[:, None, None] & h_ok[None, :, None] & (e < D)
        y = _rope_rows(src_ptr, row, tok_ok[:, None, None] & h_ok[None, :, None], cos_ptr, sin_ptr, cos_row, sin_row,
                       D, R, NEOX, HALF_TABLE, SPLIT, BLOCK_D)
        y = _round_to(y, src_ptr.dtype.element_ty, SOFT_ROUNDING)
        dst = dst_tok[:, None, None] + (offs_h * DST_STRIDE_H)[None, :, None] + e
        if MODE == _FP8_PTH:
            row = dst_tok[:, None] + (offs_h * DST_STRIDE_H)[None, :]
            _store_per_token_head(y, dst_ptr + dst, dst_ptr + row, ok, tok_ok[:, None] & h_ok[None, :], D,
                                  SOFT_ROUNDING)
        else:
            _store_dense(y, dst_ptr + dst, scale_ptr, ok, MODE, SOFT_ROUNDING)


@triton.jit(do_not_specialize=["num_tokens"])
def _rope_encode_and_cache_write_kernel(
    q_ptr,
    q_out_ptr,
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    num_tokens,
    value_cache_off,
    q_stride_t,
    key_stride_t,
    value_stride_t,
    c_stride_blk,
    c_stride_off,
    cos_stride_t,
    sin_stride_t,
    HQ: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    Q_STRIDE_H: tl.constexpr,
    K_STRIDE_H: tl.constexpr,
    V_STRIDE_H: tl.constexpr,
    C_STRIDE_H: tl.constexpr,
    PAGE: tl.constexpr,
    R: tl.constexpr,
    NEOX: tl.constexpr,
    HALF_TABLE: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_POS: tl.constexpr,
    KV_PROGRAMS: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SOFT_ROUNDING: tl.constexpr,
    SWIZZLE_V: tl.constexpr,
    PAGE_ALIGN: tl.constexpr,
    K_SCALE_STRIDE_H: tl.constexpr = 0,
    V_SCALE_STRIDE_H: tl.constexpr = 0,
):
    """See the module docstring. Program ``(i, j)``: tokens ``i*BLOCK_T ..``; ``j < KV_PROGRAMS``:
    KV heads ``j*BLOCK_H ..`` (rotate + encode + store K, encode + store V), else query heads
    ``(j - KV_PROGRAMS)*BLOCK_H ..`` (rotate into ``q_out``, contiguous ``[T, HQ, D]``)."""
    pid_h = tl.program_id(1)
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = tok < num_tokens
    tok64 = tok.to(tl.int64)
    if HAS_POS:
        row = tl.load(pos_ptr + tok, mask=in_range, other=0).to(tl.int64)
    else:
        row = tok64
    cos_tok = row * cos_stride_t
    sin_tok = row * sin_stride_t
    if pid_h < KV_PROGRAMS:
        h0 = pid_h * BLOCK_H
        slot = tl.load(slot_ptr + tok, mask=in_range, other=-1).to(tl.int64)
        tok_ok = slot >= 0
        blk = slot // PAGE
        off = slot % PAGE
        if MODE == _NVFP4:
            # NVFP4 pages split each row over the side's data and scale regions: side offsets
            # (V's including stride(1), so that its alignment is known) and the in-page token.
            k_dst, v_dst = _nvfp4_side_bases(blk, c_stride_blk, c_stride_blk, value_cache_off, PAGE_ALIGN)
            v_cache_ptr = cache_ptr
        else:
            k_dst = blk * c_stride_blk + off * c_stride_off
            v_dst = k_dst
            v_cache_ptr = cache_ptr + value_cache_off
        _rope_encode_rows(key_ptr, cache_ptr, k_scale_ptr, cos_ptr, sin_ptr, tok64 * key_stride_t, k_dst, cos_tok,
                          sin_tok, tok_ok, h0, H, K_STRIDE_H, C_STRIDE_H, D, R, NEOX, HALF_TABLE, MODE, BLOCK_H,
                          BLOCK_D, SOFT_ROUNDING, off, PAGE, K_SCALE_STRIDE_H, SPLIT)
        _encode_rows(value_ptr, v_cache_ptr, v_scale_ptr, tok64 * value_stride_t, v_dst, tok_ok, h0,
                     H, V_STRIDE_H, C_STRIDE_H, D, MODE, BLOCK_H, BLOCK_D, SOFT_ROUNDING, off, True, PAGE, SWIZZLE_V,
                     V_SCALE_STRIDE_H)
    else:
        # Names apart from the branch above: a compiled Triton `if` needs a name bound in both
        # branches to have one type (the interpreter does not check).
        q_h0 = (pid_h - KV_PROGRAMS) * BLOCK_H
        offs_h = q_h0 + tl.arange(0, BLOCK_H)
        q_ok = in_range[:, None, None] & (offs_h < HQ)[None, :, None]
        src = (tok64 * q_stride_t)[:, None, None] + (offs_h * Q_STRIDE_H)[None, :, None]
        q_row = (tok64 * (HQ * D))[:, None, None] + (offs_h * D)[None, :, None]
        if SPLIT and NEOX:
            y1, y2 = _neox_halves(q_ptr, src, q_ok, cos_ptr, sin_ptr, cos_tok[:, None, None], sin_tok[:, None, None],
                                  R, HALF_TABLE)
            q_dst = q_row + tl.arange(0, R // 2)[None, None, :]
            _store_dense(y1, q_out_ptr + q_dst, k_scale_ptr, q_ok, _NONE, SOFT_ROUNDING)
            _store_dense(y2, q_out_ptr + q_dst + R // 2, k_scale_ptr, q_ok, _NONE, SOFT_ROUNDING)
        else:
            e = tl.arange(0, BLOCK_D)[None, None, :]
            y = _rope_rows(q_ptr, src, q_ok, cos_ptr, sin_ptr, cos_tok[:, None, None], sin_tok[:, None, None], D, R,
                           NEOX, HALF_TABLE, SPLIT, BLOCK_D)
            _store_dense(y, q_out_ptr + q_row + e, k_scale_ptr, q_ok & (e < D), _NONE, SOFT_ROUNDING)


ROTATIONS = ("split", "gather")


def split_rotation_applies(is_neox: bool, rotary_dim: int, block_d: int, key_dtype: torch.dtype) -> bool:
    """Whether the split rotation gives the gathered one's bits for rows held in a ``block_d``-wide
    tile. GPT-J pairs are adjacent features, so any width; NeoX halves are whole tiles only when
    ``rotary_dim`` fills the tile (partial rotary, and head sizes that are no power of two, take
    the gathered form). Float32 rows keep the gathered form: loaded as float32 vectors, the split
    form's subtract/add pairs are vectorised by LLVM into alternating vector ops, after which the
    FMA contraction can fold the other product of ``x * c + r * s`` (an H100 run with fp fusion
    on gave other bits than the gathered form for GPT-J float32 rows; 16-bit rows, widened
    element by element, stay scalar and gave the same bits in every case run)."""
    return (not is_neox or rotary_dim == block_d) and key_dtype in (torch.bfloat16, torch.float16)


def _split_rotation(rotation: Optional[str], is_neox: bool, rotary_dim: int, block_d: int,
                    key_dtype: torch.dtype, mode: int, num_tokens: int, device: torch.device) -> bool:
    applies = split_rotation_applies(is_neox, rotary_dim, block_d, key_dtype)
    if rotation is None:
        # Where both apply, the measured choice by format and token count (kvfuse.ops.tuning).
        return applies and tuning.rope_write_policy(device).rotation(KVQuantMode(mode), num_tokens) == "split"
    if rotation not in ROTATIONS:
        raise ValueError(f"rotation={rotation!r}; allowed: {', '.join(map(repr, ROTATIONS))} or None")
    if rotation == "split" and not applies:
        raise ValueError(f"rotation='split' does not apply to {'NeoX' if is_neox else 'GPT-J'} rotary_dim={rotary_dim} "
                         f"of {key_dtype} rows in a {block_d}-wide tile (see split_rotation_applies); "
                         "allowed there: 'gather' or None")
    return rotation == "split"


def rope_encode_and_cache_write(query: Optional[torch.Tensor], key: torch.Tensor, value: torch.Tensor,
                                kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor,
                                v_scale: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                positions: Optional[torch.Tensor], rotary_dim: int, is_neox: bool,
                                kv_quant_mode: int, *, soft_rounding: Optional[bool] = None,
                                fp_fusion: Optional[bool] = None, launch_config=None,
                                rotation: Optional[str] = None) -> torch.Tensor:
    """Triton :func:`kvfuse.ops.reference.rope_encode_and_cache_write`; returns the rotated query
    (contiguous), or an empty tensor without one. ``fp_fusion``: Triton's ``enable_fp_fusion``
    (None: Triton's default, on, as Inductor's own kernels). ``rotation``: ``"split"`` (partners
    taken from the loaded rows; ValueError where :func:`split_rotation_applies` says no),
    ``"gather"`` (partners by a second load, the earlier kernel) or None: where the split form
    applies, the one :func:`kvfuse.ops.tuning.rope_write_policy` measured faster for the format
    and token count (gather for small FP8 and NVFP4 writes), else gather. Both give the same bits."""
    num_tokens, num_heads, head_size = key.shape
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device) if query is not None \
        else key.new_empty((0,))
    if num_tokens == 0:
        return q_out
    mode = int(kv_quant_mode)
    block_t, block_h, block_d, num_warps = launch_config or _launch_config(
        int(num_tokens).bit_length(), num_heads, head_size, mode, key.element_size())
    split = _split_rotation(rotation, bool(is_neox), int(rotary_dim), block_d, key.dtype, mode, int(num_tokens),
                            key.device)
    kv_programs = triton.cdiv(num_heads, block_h)
    q_heads = query.shape[1] if query is not None else 0
    grid = (triton.cdiv(num_tokens, block_t), kv_programs + triton.cdiv(q_heads, block_h))
    s = kv_cache.stride()
    swizzle_v, align = False, 1
    if mode == KVQuantMode.NVFP4:
        _, swizzle_v, align = _nvfp4_page_layout(tuple(kv_cache.shape), s)
    q = query if query is not None else key
    extra = {} if fp_fusion is None else {"enable_fp_fusion": bool(fp_fusion)}
    _rope_encode_and_cache_write_kernel[grid](
        q, q_out if query is not None else key, key, value, kv_cache, slot_mapping, k_scale, v_scale, cos, sin,
        positions if positions is not None else slot_mapping,
        num_tokens, s[1], q.stride(0), key.stride(0), value.stride(0), s[0], s[2], cos.stride(0), sin.stride(0),
        HQ=max(q_heads, 1), H=num_heads, D=head_size, Q_STRIDE_H=q.stride(1), K_STRIDE_H=key.stride(1),
        V_STRIDE_H=value.stride(1), C_STRIDE_H=s[3], PAGE=kv_cache.shape[2], R=int(rotary_dim), NEOX=bool(is_neox),
        HALF_TABLE=cos.shape[1] != rotary_dim, SPLIT=split, HAS_POS=positions is not None, KV_PROGRAMS=kv_programs,
        MODE=mode,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, SOFT_ROUNDING=_soft_rounding(soft_rounding),
        SWIZZLE_V=swizzle_v, PAGE_ALIGN=align,
        K_SCALE_STRIDE_H=scale_head_stride(k_scale, mode), V_SCALE_STRIDE_H=scale_head_stride(v_scale, mode),
        num_warps=num_warps, **extra,
    )
    return q_out
