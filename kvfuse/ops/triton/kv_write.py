"""Triton kernels for ``kvfuse::encode_kv``, ``kvfuse::cache_write`` and ``kvfuse::encode_and_cache_write``.

One kernel family, :func:`_encode_and_cache_write_kernel`, does all three: the cache format is a
``tl.constexpr`` (``MODE``: NONE cast, FP8 e4m3/e5m2, NVFP4, or COPY of already-encoded rows) and
``HAS_SLOTS`` says whether rows go to ``slot_mapping`` pages or to a dense ``[T, H, row_dim]`` output.
The numerics are exactly those of :mod:`kvfuse.ops.reference` (bit for bit on the GPU).

NVFP4 rows keep their per-row ``[D/2 data | D/16 scales]`` format in dense outputs (``encode_kv``)
and are split over the page's data and scale regions in caches (the layout of
:func:`kvfuse.kv_cache.nvfp4_page_index`, V scales 4-token interleaved where
:func:`kvfuse.kv_cache.nvfp4_v_scales_swizzled`); ``cache_write`` of encoded NVFP4 rows is the
``COPY_NVFP4`` mode, which moves bytes and splits them the same way.

Launchers (the protocols of :mod:`kvfuse.ops.registry`)::

    encode_kv(x, scale, kv_quant_mode, cache_dtype) -> rows
    cache_write(key_rows, value_rows, kv_cache, slot_mapping)
    encode_and_cache_write(key, value, kv_cache, slot_mapping, k_scale, v_scale, kv_quant_mode)

Each takes ``soft_rounding=`` (default: on exactly when interpreted), for tests that hold the
integer rounding path to the hardware converts on the GPU.

Performance notes (H100): each program moves ``BLOCK_T`` tokens x ``BLOCK_H`` heads of K and of V;
head and row strides are constexprs and no offset flows through a runtime branch, so loads and
stores vectorise to 16 bytes; per-token offsets are int64 so caches beyond 2**31 elements are
addressed correctly; tile sizes come from :func:`_launch_config`, cached per (shape, dtype, mode,
token-count bucket), so a call costs one launch and no Python-side shape math beyond a few
attribute reads. Casts and FP8 run at 90-95% of copy bandwidth from 16k tokens on; NVFP4 is
ALU-bound (an IEEE division and the E2M1 rounding per element, ~40 instructions) at ~50-55%.
See benchmarks/results/cache_write.md.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ... import envs
from ...kv_cache import (KVFormat, KVQuantMode, MixedPageLayout, check_page_contiguous, mixed_page_layout,
                         nvfp4_head_size, nvfp4_v_scales_swizzled, row_dim_for)

__all__ = ["encode_kv", "cache_write", "encode_and_cache_write"]

# MODE constexpr values: the KVQuantMode values, plus COPY (one past them) for rows that are
# already encoded and COPY_NVFP4 for encoded NVFP4 rows, whose bytes a cache page splits over
# two regions (a plain copy cannot place them).
_NONE = tl.constexpr(int(KVQuantMode.NONE))
_FP8_E4M3 = tl.constexpr(int(KVQuantMode.FP8_E4M3))
_FP8_E5M2 = tl.constexpr(int(KVQuantMode.FP8_E5M2))
_NVFP4 = tl.constexpr(int(KVQuantMode.NVFP4))
_FP8_PTH = tl.constexpr(int(KVQuantMode.FP8_PER_TOKEN_HEAD))
_MODE_COPY = max(KVQuantMode) + 1
_COPY = tl.constexpr(_MODE_COPY)
_MODE_COPY_NVFP4 = _MODE_COPY + 1
_COPY_NVFP4 = tl.constexpr(_MODE_COPY_NVFP4)


def _soft_rounding(requested: Optional[bool]) -> bool:
    """FP8 / bfloat16 rounding in integer ops instead of the hardware converts: needed under the
    Triton interpreter, whose float8 and bfloat16 conversions do not round to nearest even (see
    :func:`_fp8_rne`); on the GPU tests ask for it to prove both paths give the same bits."""
    return envs.settings().triton_interpret if requested is None else requested

_NUM_SMS_GUESS = 132  # only shapes the grid; a wrong guess costs a little occupancy, not correctness


# ----------------------------------------------------------------------------- device helpers


@triton.jit
def _fp8_rne(v, MANT: tl.constexpr, BIAS: tl.constexpr):
    """Round float32 ``v`` (|v| within the format's finite range, or NaN) to an FP8 code.

    Returns ``(code uint8, value float32)`` for e4m3fn (MANT=3, BIAS=7) or e5m2 (MANT=2, BIAS=15),
    round to nearest even, sign kept (-0 too), NaN -> ``0x7F | sign`` as PyTorch encodes it.
    Integer ops instead of the hardware convert, so that the Triton interpreter (whose float8
    conversion neither rounds to even nor carries into the exponent) gives the GPU's bits.
    Normal range: round the 23-bit mantissa to MANT bits (a carry into the exponent is the
    correct result). Subnormal range (step ``2**(1 - BIAS - MANT)``): ``rint(|v| / step)`` by the
    2**23 trick; the code ``2**MANT`` it may produce is the smallest normal, as wanted.
    """
    DROP: tl.constexpr = 23 - MANT
    bits = v.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag_bits = bits ^ sign
    KEEP: tl.constexpr = (0xFFFFFFFF >> DROP) << DROP
    rounded = (mag_bits + ((1 << (DROP - 1)) - 1) + ((mag_bits >> DROP) & 1)) & KEEP
    exp = (rounded >> 23).to(tl.int32) - (127 - BIAS)
    normal_code = (exp << MANT) | ((rounded >> DROP) & ((1 << MANT) - 1)).to(tl.int32)
    normal_val = rounded.to(tl.float32, bitcast=True)
    a = mag_bits.to(tl.float32, bitcast=True)
    INV_STEP: tl.constexpr = float(2 ** (BIAS + MANT - 1))
    sub = (a * INV_STEP + 8388608.0) - 8388608.0
    is_sub = a < float(2.0 ** (1 - BIAS))
    code = tl.where(is_sub, tl.where(is_sub, sub, 0.0).to(tl.int32), normal_code)  # no NaN -> int cast
    val = tl.where(is_sub, sub * (1.0 / INV_STEP), normal_val)
    code = tl.where(v != v, 0x7F, code) | (sign >> 24).to(tl.int32)
    val = tl.where(v != v, v, tl.where(sign != 0, -val, val))
    return code.to(tl.uint8), val


@triton.jit
def _encode_rows(
    src_ptr,
    dst_ptr,
    scale_ptr,
    src_tok,  # [BLOCK_T] int64 element offset of each token's row in src
    dst_tok,  # [BLOCK_T] int64 element offset of each token's row in dst (NVFP4 pages: of its page side)
    tok_ok,  # [BLOCK_T] bool: write this token
    h0,
    H: tl.constexpr,
    SRC_STRIDE_H: tl.constexpr,
    DST_STRIDE_H: tl.constexpr,
    D: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SOFT_ROUNDING: tl.constexpr,
    dst_off,  # [BLOCK_T] int64 in-page token offset (read for NVFP4 pages only)
    PAGED: tl.constexpr,  # NVFP4 rows go to cache pages (else to dense rows)
    PAGE: tl.constexpr,
    SWIZZLE: tl.constexpr,  # NVFP4 pages: this side's scales are 4-token interleaved (V)
    SCALE_STRIDE_H: tl.constexpr,
):
    """Encode ``[BLOCK_T, BLOCK_H, D]`` of one tensor and store the rows; see the kernel docstring."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    scale_ptr = _head_scale_ptr(scale_ptr, offs_h, H, SCALE_STRIDE_H)
    if MODE == _NVFP4:
        BLOCK_NB: tl.constexpr = BLOCK_D // 16
        offs_b = tl.arange(0, BLOCK_NB)
        offs_i = tl.arange(0, 16)
        row_ok = tok_ok[:, None, None] & h_ok[None, :, None] & (offs_b < D // 16)[None, None, :]
        src = (
            src_tok[:, None, None, None]
            + (offs_h * SRC_STRIDE_H)[None, :, None, None]
            + (offs_b * 16)[None, None, :, None]
            + offs_i[None, None, None, :]
        )
        x = tl.load(src_ptr + src, mask=row_ok[:, :, :, None]).to(tl.float32)
        _store_nvfp4(x, dst_ptr, scale_ptr, dst_tok, offs_h, row_ok, DST_STRIDE_H, D, BLOCK_H, BLOCK_D,
                     dst_off, H, PAGED, PAGE, SWIZZLE)
    elif MODE == _COPY_NVFP4:
        # Encoded rows [D/2 data | D/16 scales], read as the same (block, byte) tiles the encoder
        # stores, so that both share _put_nvfp4's addressing.
        BLOCK_NB: tl.constexpr = BLOCK_D // 16
        offs_b = tl.arange(0, BLOCK_NB)
        row_ok = tok_ok[:, None, None] & h_ok[None, :, None] & (offs_b < D // 16)[None, None, :]
        src_row = src_tok[:, None, None] + (offs_h * SRC_STRIDE_H)[None, :, None]
        offs_j = tl.arange(0, 8)
        packed = tl.load(src_ptr + src_row[:, :, :, None] + (offs_b * 8)[None, None, :, None]
                         + offs_j[None, None, None, :], mask=row_ok[:, :, :, None])
        s_code = tl.load(src_ptr + src_row + D // 2 + offs_b[None, None, :], mask=row_ok)
        _put_nvfp4(packed, s_code, dst_ptr, dst_tok, dst_off, offs_h, row_ok, DST_STRIDE_H, H, D, BLOCK_NB,
                   PAGED, PAGE, SWIZZLE)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        ok = tok_ok[:, None, None] & h_ok[None, :, None] & (offs_d < D)[None, None, :]
        src = src_tok[:, None, None] + (offs_h * SRC_STRIDE_H)[None, :, None] + offs_d[None, None, :]
        dst = dst_tok[:, None, None] + (offs_h * DST_STRIDE_H)[None, :, None] + offs_d[None, None, :]
        x = tl.load(src_ptr + src, mask=ok)
        if MODE == _FP8_PTH:
            row = dst_tok[:, None] + (offs_h * DST_STRIDE_H)[None, :]
            _store_per_token_head(x, dst_ptr + dst, dst_ptr + row, ok, tok_ok[:, None] & h_ok[None, :], D,
                                  SOFT_ROUNDING)
        else:
            _store_dense(x, dst_ptr + dst, scale_ptr, ok, MODE, SOFT_ROUNDING)


@triton.jit
def _store_per_token_head(x, dst, row_ptr, ok, row_ok, D: tl.constexpr, SOFT_ROUNDING: tl.constexpr):
    """FP8_PER_TOKEN_HEAD: encode ``x [BLOCK_T, BLOCK_H, BLOCK_D]`` (whole rows: BLOCK_D >= D) with
    one scale per row, store the e4m3 bytes at the uint8 pointers ``dst`` and each row's float32
    scale at ``row_ptr + D`` (``row_ptr [BLOCK_T, BLOCK_H]``: the rows' first bytes, 4-byte aligned,
    as the op layer checks). Math: :func:`kvfuse.kv_cache.fp8_per_token_head_quantize_reference`."""
    xf = x.to(tl.float32)
    # NaN and +-inf stay out of the amax (every compare with NaN is False).
    mag = tl.where(ok & (tl.abs(xf) < float("inf")), tl.abs(xf), 0.0)
    amax = tl.max(mag, axis=2)
    scale = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1e-6)
    recip = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    q = xf * recip[:, :, None]
    q_nan = q != q
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if SOFT_ROUNDING:
        bits, _ = _fp8_rne(q, 3, 7)
    else:
        bits = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    sign = ((xf.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    bits = tl.where(q_nan, sign | 0x7F, bits)
    tl.store(dst, bits, mask=ok)
    tl.store((row_ptr + D).to(tl.pointer_type(tl.float32)), scale, mask=row_ok)


@triton.jit
def _head_scale_ptr(scale_ptr, offs_h, H: tl.constexpr, SCALE_STRIDE_H: tl.constexpr):
    """The scale pointer of each row: ``scale_ptr`` itself for a per-tensor scale (SCALE_STRIDE_H 0,
    one scalar load), else ``[1, BLOCK_H, 1]`` pointers ``scale_ptr + h * SCALE_STRIDE_H`` (heads past
    ``H`` read the last head's scale, so the load needs no mask), which broadcast over the rows."""
    if SCALE_STRIDE_H == 0:
        return scale_ptr
    else:
        return scale_ptr + (tl.minimum(offs_h, H - 1) * SCALE_STRIDE_H)[None, :, None]


@triton.jit
def _store_nvfp4(
    x,  # [BLOCK_T, BLOCK_H, BLOCK_D // 16, 16] float32 values of the rows
    dst_ptr,
    scale_ptr,  # the global scale: one pointer, or [1, BLOCK_H, 1] per head (_head_scale_ptr)
    dst_tok,  # [BLOCK_T] int64 element offset of each token's row in dst (PAGED: of its page side)
    offs_h,  # [BLOCK_H] head indices
    row_ok,  # [BLOCK_T, BLOCK_H, BLOCK_D // 16] write this 16-block
    DST_STRIDE_H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    dst_off,  # [BLOCK_T] int64 in-page token offset (PAGED only)
    H: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,
    SWIZZLE: tl.constexpr,
):
    """NVFP4-encode ``x`` (block scales + packed E2M1) and store it (:func:`_put_nvfp4`); see the kernel docstring."""
    BLOCK_NB: tl.constexpr = BLOCK_D // 16
    # NaN encodes as +0 and is ignored by amax: zero it once, here, so that nothing below
    # needs a per-element NaN test (those selects are what this ALU-bound path pays for).
    x = tl.where(x == x, x, 0.0)
    gs = tl.load(scale_ptr)
    amax = tl.max(tl.abs(x), axis=3)
    s = tl.minimum(tl.math.div_rn(amax, gs * 6.0), 448.0, propagate_nan=tl.PropagateNan.ALL)
    s_code, s_val = _fp8_rne(s, 3, 7)
    # Blocks whose divisor s * gs is not > 0 encode all-zero codes (the reference's q = 0):
    # per block, a safe divisor and a code mask.
    pos = s_val * gs > 0
    denom = tl.where(pos, s_val * gs, 1.0)
    keep = tl.where(pos, 0xF, 0).to(tl.uint32)
    # One correctly rounded reciprocal per block, then a product per element (the reference's
    # definition): a division per element was most of this kernel's ALU work.
    q = x * tl.math.div_rn(1.0, denom)[:, :, :, None]
    # E2M1 round-to-nearest-even, saturating at 6, as rint on the binade's grid: steps of 0.5
    # below 2 (codes 0..4), of 1 in [2, 4) (codes 4..6), of 2 from 4 (codes 6, 7); the grid
    # points' own ties (0.25, 1.25, 2.5, 5 down; 0.75, 1.75, 3.5 up) are rint's ties to even.
    # The binade comes from the float's exponent bits, with no compare or select (this kernel is
    # bound by instruction issue, benchmarks/sass_count.py): e = max(exponent field, that of 1.0)
    # gives the scale m = 2**(1 - k) (k = 0, 1, 2 for |q| < 2, [2, 4), [4, 6]) as the bits
    # 0x7F800000 - e, and (e >> 22) = 254 + 2k. rint(a * m) is the 1.5 * 2**23 trick (a * m is
    # exact: m is a power of two); with 2 more in the constant, the sum's bits end in
    # rint(a * m) + 2, and (sum + (e >> 22)) mod 16 is the code rint(a * m) + 2k (0x4B400000 and
    # 256 vanish mod 16), so no subtraction is needed: `keep` below masks the low 4 bits.
    a = tl.minimum(tl.abs(q), 6.0)
    e = tl.maximum(a.to(tl.uint32, bitcast=True) & 0x7F800000, 0x3F800000)
    m = (0x7F800000 - e).to(tl.float32, bitcast=True)
    r = (a * m + 12582914.0).to(tl.uint32, bitcast=True)
    # Codes stay 32-bit until the pairs are packed: one narrowing per byte, not one per element.
    # The block mask `keep` (0xF, or 0 for a block that encodes as zeros) both keeps the code's
    # low 4 bits and zeroes dead blocks. It goes on the codes, in the layout they are computed in:
    # on the packed bytes it needed a layout conversion of its own through shared memory.
    code = ((r + (e >> 22)) | tl.where(q < 0, 8, 0).to(tl.uint32)) & keep[:, :, :, None]
    pairs = tl.reshape(code, (code.shape[0], BLOCK_H, BLOCK_NB, 8, 2))
    lo, hi = tl.split(pairs)
    packed = (lo | (hi << 4)).to(tl.uint8)
    _put_nvfp4(packed, s_code, dst_ptr, dst_tok, dst_off, offs_h, row_ok, DST_STRIDE_H, H, D, BLOCK_NB,
               PAGED, PAGE, SWIZZLE)


@triton.jit
def _put_nvfp4(
    packed,  # [BLOCK_T, BLOCK_H, BLOCK_NB, 8] uint8: byte k of 16-block b's packed codes
    s_code,  # [BLOCK_T, BLOCK_H, BLOCK_NB] uint8: e4m3 scale of block b
    dst_ptr,
    dst_tok,  # [BLOCK_T] int64: row offset (dense), or offset of the token's page side (PAGED)
    dst_off,  # [BLOCK_T] int64: in-page token offset t (PAGED only)
    offs_h,  # [BLOCK_H] head indices
    row_ok,  # [BLOCK_T, BLOCK_H, BLOCK_NB] write this 16-block
    DST_STRIDE_H: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,
    SWIZZLE: tl.constexpr,
):
    """Store NVFP4 rows: dense ``[D/2 data | D/16 scales]`` rows, or split over a page side
    (:func:`kvfuse.kv_cache.nvfp4_page_index`, ``T = PAGE``, ``S = D/16``)::

        data  (t, h, i) at side + (t*H + h) * D/2 + i
        scale (t, h, j) at side + T*H*D/2 + (t*H + h) * S + j                       (K, SWIZZLE off)
                        at side + T*H*D/2 + (4*(t//4) + j//(S/4))*H*S + h*S + 4*(j % (S/4)) + t%4   (V)
    """
    offs_b = tl.arange(0, BLOCK_NB)
    offs_j = tl.arange(0, 8)
    S: tl.constexpr = D // 16
    if PAGED:
        # Token, head and block terms kept apart (each a constexpr multiple) so that the data
        # bytes of a block stay provably 8-aligned and contiguous: one 8-byte store.
        data_row = (dst_tok + dst_off * (H * (D // 2)))[:, None, None] + (offs_h * (D // 2))[None, :, None]
        scale_region = dst_tok + PAGE * H * (D // 2)
        if SWIZZLE:
            G: tl.constexpr = S // 4
            scale_tok = scale_region + (dst_off // 4) * (4 * H * S) + dst_off % 4
            scale_b = (offs_b // G) * (H * S) + (offs_b % G) * 4
        else:
            scale_tok = scale_region + dst_off * (H * S)
            scale_b = offs_b
        scale = scale_tok[:, None, None] + (offs_h * S)[None, :, None] + scale_b[None, None, :]
    else:
        data_row = dst_tok[:, None, None] + (offs_h * DST_STRIDE_H)[None, :, None]
        scale = data_row + D // 2 + offs_b[None, None, :]
    # NVFP4 rows are uint8 (caches and encode_kv outputs alike): no pointer cast, which
    # would hide the pointer's alignment and split the stores into bytes.
    tl.store(
        dst_ptr + data_row[:, :, :, None] + (offs_b * 8)[None, None, :, None] + offs_j[None, None, None, :],
        packed,
        mask=row_ok[:, :, :, None],
    )
    tl.store(dst_ptr + scale, s_code, mask=row_ok)


@triton.jit
def _nvfp4_side_bases(blk, k_stride_blk, v_stride_blk, value_off, ALIGN: tl.constexpr):
    """Offsets of blocks ``blk``'s K and V page sides, with the alignment the host proved
    (Triton itself only learns 16-divisibility of integer arguments)."""
    k_side = blk * k_stride_blk
    v_side = blk * v_stride_blk + value_off
    if ALIGN > 1:
        k_side = tl.multiple_of(k_side, ALIGN)
        v_side = tl.multiple_of(v_side, ALIGN)
    return k_side, v_side


@triton.jit
def _mixed_side_base(blk, off, stride_blk, stride_off, side_off, MODE: tl.constexpr, ALIGN: tl.constexpr):
    """Element offset of the rows of one side of a mixed-format page: the side's base for NVFP4
    (whose rows split over the side's data and scale regions, :func:`_put_nvfp4`), else the row
    of in-page token ``off``."""
    if MODE == _NVFP4:
        base = blk * stride_blk + side_off
        if ALIGN > 1:
            base = tl.multiple_of(base, ALIGN)
        return base
    else:
        return blk * stride_blk + off * stride_off + side_off


@triton.jit
def _store_dense(x, dst, scale_ptr, ok, MODE: tl.constexpr, SOFT_ROUNDING: tl.constexpr):
    """Encode ``x`` (any shape) for a NONE / FP8 / COPY cache and store it at the pointers ``dst``;
    ``scale_ptr`` is one pointer or pointers that broadcast over ``x`` (per head: :func:`_head_scale_ptr`)."""
    if MODE == _COPY:
        tl.store(dst, x, mask=ok)
    elif MODE == _NONE:
        # Through float32 (exact), then Triton's default narrowing, round-to-nearest-even, as
        # PyTorch converts; the direct fp16 <-> bf16 cast is wrong in the interpreter.
        xf = x.to(tl.float32)
        if SOFT_ROUNDING and dst.dtype.element_ty == tl.bfloat16:
            # The interpreter truncates float32 -> bfloat16; round to nearest even by hand.
            b = xf.to(tl.uint32, bitcast=True)
            b = tl.where(xf != xf, b | 0x400000, b + 0x7FFF + ((b >> 16) & 1))
            y = (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            y = xf.to(dst.dtype.element_ty)
        tl.store(dst, y, mask=ok)
    else:
        if MODE == _FP8_E4M3:
            fp8_max = 448.0
        else:
            fp8_max = 57344.0
        xf = x.to(tl.float32)
        q = tl.math.div_rn(xf, tl.load(scale_ptr))
        q_nan = q != q  # NaN input, or 0/0 and inf/inf: min/max below would drop the NaN
        q = tl.minimum(tl.maximum(q, -fp8_max), fp8_max)
        if SOFT_ROUNDING:
            if MODE == _FP8_E4M3:
                bits, _ = _fp8_rne(q, 3, 7)
            else:
                bits, _ = _fp8_rne(q, 2, 15)
        else:
            # sm89+ lowers this to cvt.rn.satfinite (round to nearest even).
            bits = q.to(dst.dtype.element_ty).to(tl.uint8, bitcast=True)
        # NaN stays NaN, with the input's sign as PyTorch's float8 conversion keeps it (the
        # hardware convert would give one canonical NaN).
        sign = ((xf.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
        bits = tl.where(q_nan, sign | 0x7F, bits)
        tl.store(dst, bits.to(dst.dtype.element_ty, bitcast=True), mask=ok)


@triton.jit(do_not_specialize=["num_tokens"])
def _encode_and_cache_write_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_tokens,
    value_cache_off,
    key_stride_t,
    value_stride_t,
    kc_stride_blk,
    kc_stride_off,
    vc_stride_blk,
    vc_stride_off,
    H: tl.constexpr,
    D: tl.constexpr,
    K_STRIDE_H: tl.constexpr,
    V_STRIDE_H: tl.constexpr,
    KC_STRIDE_H: tl.constexpr,
    VC_STRIDE_H: tl.constexpr,
    PAGE: tl.constexpr,
    MODE: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    PAIR: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SOFT_ROUNDING: tl.constexpr,
    SWIZZLE_V: tl.constexpr,
    PAGE_ALIGN: tl.constexpr,
    K_SCALE_STRIDE_H: tl.constexpr = 0,
    V_SCALE_STRIDE_H: tl.constexpr = 0,
    V_MODE: tl.constexpr = -1,
):
    """Encode K and V rows and store them at their cache slots.

    Program ``(i, j)`` handles tokens ``i*BLOCK_T ..`` and heads ``j*BLOCK_H ..`` of K and, with
    ``PAIR``, of V. For token ``t`` with ``slot = slot_mapping[t] >= 0`` (slot < 0: skipped) the row
    lands at ``cache[slot // PAGE, slot % PAGE, h]``; with ``HAS_SLOTS=False`` at ``out[t, h]``.
    Per row ``x`` (``D`` values), by ``MODE``:

    - NONE: ``x`` converted to the cache dtype, round to nearest even;
    - FP8 (e4m3 max 448, e5m2 max 57344): ``rne(clamp(x / scale, -max, max))``, IEEE division,
      NaN -> NaN;
    - NVFP4, per 16-block ``b``: ``amax = max |x_i|`` (NaN ignored),
      ``s = e4m3_rne(min(amax / (gs * 6), 448))``, ``q_i = x_i * (1 / (s * gs))`` (0 if ``s * gs`` is 0),
      E2M1 code of ``q_i`` (RNE, saturating at 6, sign in bit 3, NaN -> +0); the row is
      ``[D/2 bytes, code 2k in the low nibble of byte k | D/16 e4m3 scales]``;
    - FP8_PER_TOKEN_HEAD: per row, ``scale = max(amax / 448, 1e-6)`` (amax over finite values),
      ``rne(clamp(x * (1 / scale), -448, 448))`` as e4m3 bytes, then the scale's 4 bytes
      (:func:`_store_per_token_head`); ``k_scale`` / ``v_scale`` are not read;
    - COPY: rows already in the cache format, stored as they are;
    - COPY_NVFP4: encoded NVFP4 rows (``D`` is the head size), their bytes stored as NVFP4 pages
      hold them.

    NVFP4 into a cache (NVFP4, COPY_NVFP4 with ``HAS_SLOTS``): the row's data and scale bytes go
    to its page side's two regions (:func:`_put_nvfp4`); V scales 4-token interleaved when
    ``SWIZZLE_V``; ``PAGE_ALIGN`` divides the page sides' offsets (the cache strides 0 and 1).

    ``scale`` is ``k_scale`` / ``v_scale``, or with ``*_SCALE_STRIDE_H > 0`` (per-KV-head scales)
    ``scale[h * *_SCALE_STRIDE_H]`` for the rows of head ``h``.

    ``V_MODE >= 0``: a mixed format (:func:`kvfuse.kv_cache.mixed_page_layout`): K is encoded by
    ``MODE`` and V by ``V_MODE``, each side through its own typed view of the page bytes
    (``key_cache_ptr`` / ``value_cache_ptr``, strides in that view's elements) and V's side
    starting ``value_cache_off`` elements into its page; a side of NVFP4 pages is addressed from
    its side's base, as in a uniform NVFP4 cache.

    K and V share a program (rather than a grid axis and a runtime branch) because offsets that
    flow out of a branch lose Triton's alignment facts, and the stores stop being 16-byte wide.
    """
    h0 = tl.program_id(1) * BLOCK_H
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = tok < num_tokens
    tok64 = tok.to(tl.int64)
    if V_MODE >= 0:
        slot = tl.load(slot_ptr + tok, mask=in_range, other=-1).to(tl.int64)
        tok_ok = slot >= 0
        blk = slot // PAGE
        off = slot % PAGE
        k_dst = _mixed_side_base(blk, off, kc_stride_blk, kc_stride_off, 0, MODE, PAGE_ALIGN)
        v_dst = _mixed_side_base(blk, off, vc_stride_blk, vc_stride_off, value_cache_off, V_MODE, PAGE_ALIGN)
        _encode_rows(key_ptr, key_cache_ptr, k_scale_ptr, tok64 * key_stride_t, k_dst, tok_ok, h0,
                     H, K_STRIDE_H, KC_STRIDE_H, D, MODE, BLOCK_H, BLOCK_D, SOFT_ROUNDING, off, True, PAGE, False,
                     K_SCALE_STRIDE_H)
        _encode_rows(value_ptr, value_cache_ptr, v_scale_ptr, tok64 * value_stride_t, v_dst, tok_ok, h0,
                     H, V_STRIDE_H, VC_STRIDE_H, D, V_MODE, BLOCK_H, BLOCK_D, SOFT_ROUNDING, off, True, PAGE,
                     SWIZZLE_V, V_SCALE_STRIDE_H)
    else:
        # An else branch, not an early return: the compiler builds code after a return too, and
        # the uniform path's one MODE cannot store a mixed format's other side.
        if HAS_SLOTS:
            slot = tl.load(slot_ptr + tok, mask=in_range, other=-1).to(tl.int64)
            tok_ok = slot >= 0
            blk = slot // PAGE
            off = slot % PAGE
            if MODE == _NVFP4 or MODE == _COPY_NVFP4:
                # The side offsets, not fused row offsets: a page splits each row over two regions.
                # V's offset includes stride(1) (not the pointer) so that its alignment is known.
                k_dst, v_dst = _nvfp4_side_bases(blk, kc_stride_blk, vc_stride_blk, value_cache_off, PAGE_ALIGN)
                v_cache_ptr = value_cache_ptr
            else:
                k_dst = blk * kc_stride_blk + off * kc_stride_off
                v_dst = blk * vc_stride_blk + off * vc_stride_off
                v_cache_ptr = value_cache_ptr + value_cache_off
        else:
            tok_ok = in_range
            off = tok64
            k_dst = tok64 * kc_stride_off
            v_dst = tok64 * vc_stride_off
            v_cache_ptr = value_cache_ptr + value_cache_off
        _encode_rows(key_ptr, key_cache_ptr, k_scale_ptr, tok64 * key_stride_t, k_dst, tok_ok, h0,
                     H, K_STRIDE_H, KC_STRIDE_H, D, MODE, BLOCK_H, BLOCK_D, SOFT_ROUNDING, off, HAS_SLOTS, PAGE, False,
                     K_SCALE_STRIDE_H)
        if PAIR:
            _encode_rows(value_ptr, v_cache_ptr, v_scale_ptr, tok64 * value_stride_t, v_dst,
                         tok_ok, h0, H, V_STRIDE_H, VC_STRIDE_H, D, MODE, BLOCK_H, BLOCK_D, SOFT_ROUNDING, off,
                         HAS_SLOTS, PAGE, SWIZZLE_V, V_SCALE_STRIDE_H)


# ----------------------------------------------------------------------------- launch configuration


@functools.lru_cache(maxsize=4096)
def _launch_config(t_bucket: int, num_heads: int, width: int, mode: int, in_bytes: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_H, BLOCK_D, num_warps) for ``2**(t_bucket-1)``+ tokens of ``num_heads x width``.

    Per program, about 2048 elements of K (and as many of V) at 8 per thread for casts and
    copies, 1024 at 16 per thread for FP8 / NVFP4 (more independent work per thread hides the
    division's latency): the best of a sweep on an H100 (benchmarks/cache_write.py --sweep).
    Small token counts shrink the tile (tokens first, then heads) so the grid covers every SM.
    """
    block_d = triton.next_power_of_2(width)
    if mode == KVQuantMode.NVFP4 or mode == _MODE_COPY_NVFP4:  # width: the head size
        block_d = 16 * triton.next_power_of_2(width // 16)
    quantized = mode in (KVQuantMode.FP8_E4M3, KVQuantMode.FP8_E5M2, KVQuantMode.NVFP4, KVQuantMode.FP8_PER_TOKEN_HEAD)
    # NVFP4 copies count head-size elements, two a byte: 16 keeps 8 data bytes a thread, one store.
    per_thread = 16 if quantized or mode == _MODE_COPY_NVFP4 else 8
    target = (1024 if quantized else 2048) * (2 if in_bytes == 1 else 1)
    block_h = triton.next_power_of_2(num_heads)
    block_t = max(1, min(16, target // (block_h * block_d)))
    tokens = 1 << max(t_bucket - 1, 0)
    while block_t > 1 and triton.cdiv(tokens, block_t) < 4 * _NUM_SMS_GUESS:
        block_t //= 2
    while (block_h > 1 and block_h * block_d > 256
           and triton.cdiv(tokens, block_t) * triton.cdiv(num_heads, block_h) < 2 * _NUM_SMS_GUESS):
        block_h //= 2
    num_warps = max(1, min(8, block_t * block_h * block_d // (32 * per_thread)))
    return block_t, block_h, block_d, num_warps


def _pow2_divisor(n: int, limit: int = 16) -> int:
    """The largest power of two <= ``limit`` that divides ``n`` (``limit`` for 0)."""
    n = abs(int(n))
    return limit if n == 0 else min(limit, n & -n)


@functools.lru_cache(maxsize=1024)
def _nvfp4_page_layout(shape: tuple, strides: tuple) -> tuple[int, bool, int]:
    """``(head_size, SWIZZLE_V, PAGE_ALIGN)`` of an NVFP4 cache ``(blocks, 2, T, H, row_dim)``;
    ValueError for a cache whose pages are not contiguous (the page layout addresses bytes)."""
    _, _, block_size, _, row_dim = shape
    head_size = nvfp4_head_size(row_dim)
    problem = check_page_contiguous(torch.empty_strided(shape, strides, device="meta"))
    if problem is not None:
        raise ValueError(f"kv_cache {shape}: NVFP4 caches need contiguous pages; {problem}")
    # Side offsets are sums of multiples of strides 0 and 1 (bytes: the cache is uint8).
    align = min(_pow2_divisor(strides[0]), _pow2_divisor(strides[1]))
    return head_size, nvfp4_v_scales_swizzled(block_size, head_size), align


def _launch(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, num_tokens, num_heads,
            width, mode, has_slots, kc_strides, vc_strides, num_kv, value_cache_off=0, soft_rounding=None,
            launch_config=None, swizzle_v=False, page_align=1, v_mode=-1):
    block_t, block_h, block_d, num_warps = launch_config or _launch_config(
        int(num_tokens).bit_length(), num_heads, width, mode, key.element_size()
    )
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_heads, block_h))
    return _encode_and_cache_write_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
        num_tokens, value_cache_off, key.stride(0), value.stride(0),
        kc_strides[0], kc_strides[1], vc_strides[0], vc_strides[1],
        H=num_heads, D=width,
        K_STRIDE_H=key.stride(1), V_STRIDE_H=value.stride(1),
        KC_STRIDE_H=kc_strides[2], VC_STRIDE_H=vc_strides[2],
        PAGE=key_cache.shape[-3] if has_slots else 1,
        MODE=mode, HAS_SLOTS=has_slots, PAIR=num_kv == 2,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, SOFT_ROUNDING=_soft_rounding(soft_rounding),
        SWIZZLE_V=swizzle_v, PAGE_ALIGN=page_align,
        K_SCALE_STRIDE_H=scale_head_stride(k_scale, mode),
        V_SCALE_STRIDE_H=scale_head_stride(v_scale, mode if v_mode < 0 else v_mode),
        num_warps=num_warps, **({"V_MODE": v_mode} if v_mode >= 0 else {}),
    )


_SCALED_MODES = frozenset({int(KVQuantMode.FP8_E4M3), int(KVQuantMode.FP8_E5M2), int(KVQuantMode.NVFP4)})


def scale_head_stride(scale: torch.Tensor, mode: int) -> int:
    """Elements between consecutive heads' scales: 0 for a one-element (per-tensor) scale and for the
    modes that read no scale (casts; copies, which get a placeholder tensor), so those compile once."""
    return scale.stride(0) if mode in _SCALED_MODES and scale.numel() > 1 else 0


# ----------------------------------------------------------------------------- launchers
# ``launch_config``: (BLOCK_T, BLOCK_H, BLOCK_D, num_warps) instead of :func:`_launch_config`'s
# (benchmarks sweep tiles through it).


def encode_kv(x: torch.Tensor, scale: torch.Tensor, kv_quant_mode: int, cache_dtype: torch.dtype, *,
              soft_rounding: Optional[bool] = None, launch_config=None) -> torch.Tensor:
    """Triton :func:`kvfuse.ops.reference.encode_kv`: ``x [T, H, D]`` -> rows ``[T, H, row_dim]``."""
    mode = int(kv_quant_mode)
    num_tokens, num_heads, head_size = x.shape
    row_dim = row_dim_for(mode, head_size) if mode in (KVQuantMode.NVFP4, KVQuantMode.FP8_PER_TOKEN_HEAD) \
        else head_size
    out = torch.empty((num_tokens, num_heads, row_dim), dtype=cache_dtype, device=x.device)
    if num_tokens == 0:
        return out
    strides = (0, out.stride(0), out.stride(1))
    _launch(x, x, out, out, x, scale, scale, num_tokens, num_heads, head_size, mode, False,
            strides, strides, 1, soft_rounding=soft_rounding, launch_config=launch_config)
    return out


def cache_write(key_rows: torch.Tensor, value_rows: torch.Tensor, kv_cache: torch.Tensor,
                slot_mapping: torch.Tensor, kv_quant_mode: Optional[int] = None, *, launch_config=None) -> None:
    """Triton :func:`kvfuse.ops.reference.cache_write` into an NHD ``(blocks, 2, page, H, row_dim)`` cache
    (``kv_quant_mode`` None: a uint8 cache holds NVFP4 pages)."""
    num_tokens, num_heads, row_dim = key_rows.shape
    if num_tokens == 0:
        return
    s = kv_cache.stride()
    strides = (s[0], s[2], s[3])
    nvfp4 = kv_cache.dtype == torch.uint8 if kv_quant_mode is None else int(kv_quant_mode) == KVQuantMode.NVFP4
    if nvfp4:
        head_size, swizzle_v, align = _nvfp4_page_layout(tuple(kv_cache.shape), s)
        _launch(key_rows, value_rows, kv_cache, kv_cache, slot_mapping, slot_mapping, slot_mapping,
                num_tokens, num_heads, head_size, _MODE_COPY_NVFP4, True, strides, strides, 2, s[1],
                launch_config=launch_config, swizzle_v=swizzle_v, page_align=align)
        return
    # Rows are moved as raw bytes (e.g. fp8) in their own dtype. V lives one stride(1) past K in
    # the same tensor: an offset, not a sliced view (saves host time).
    _launch(key_rows, value_rows, kv_cache, kv_cache, slot_mapping, slot_mapping, slot_mapping,
            num_tokens, num_heads, row_dim, _MODE_COPY, True, strides, strides, 2, s[1],
            launch_config=launch_config)


def encode_and_cache_write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                           kv_quant_mode: int, *, soft_rounding: Optional[bool] = None,
                           launch_config=None) -> None:
    """Triton :func:`kvfuse.ops.reference.encode_and_cache_write`: one pass, K and V, any cache format."""
    num_tokens, num_heads, head_size = key.shape
    if num_tokens == 0:
        return
    s = kv_cache.stride()
    strides = (s[0], s[2], s[3])
    mode = int(kv_quant_mode)
    if mode not in _UNIFORM_MODES:
        _encode_and_cache_write_mixed(key, value, kv_cache, slot_mapping, k_scale, v_scale, KVFormat.from_code(mode),
                                      soft_rounding, launch_config)
        return
    swizzle_v, align = False, 1
    if mode == KVQuantMode.NVFP4:
        _, swizzle_v, align = _nvfp4_page_layout(tuple(kv_cache.shape), s)
    _launch(key, value, kv_cache, kv_cache, slot_mapping, k_scale, v_scale, num_tokens, num_heads,
            head_size, mode, True, strides, strides, 2, s[1], soft_rounding=soft_rounding,
            launch_config=launch_config, swizzle_v=swizzle_v, page_align=align)


_UNIFORM_MODES = frozenset(int(m) for m in KVQuantMode)


def mixed_side_views(kv_cache: torch.Tensor, layout: MixedPageLayout) -> tuple[tuple, tuple]:
    """For each side of a mixed-format cache: ``(view, (page stride, row stride, head stride), side
    offset)``, the view being the uint8 cache reinterpreted as the side's storage dtype (the op layer
    checked that pages are contiguous and 4-byte aligned, and the layout's row_dim keeps every
    view's strides whole) and every stride and offset counted in that view's elements."""
    sides = []
    for side in (0, 1):
        dtype = layout.storage_dtype(side)
        size = dtype.itemsize
        view = kv_cache if dtype == torch.uint8 else kv_cache.view(dtype)
        row = layout.row_bytes[side] // size
        sides.append((view, (kv_cache.stride(0) // size, layout.num_kv_heads * row, row),
                      layout.side_offsets[side] // size))
    return tuple(sides)


def _encode_and_cache_write_mixed(key, value, kv_cache, slot_mapping, k_scale, v_scale, fmt: KVFormat,
                                  soft_rounding, launch_config) -> None:
    """One launch writing K in ``fmt.key`` and V in ``fmt.value`` into mixed pages."""
    num_tokens, num_heads, head_size = key.shape
    layout = mixed_page_layout(fmt, kv_cache.shape[2], num_heads, head_size, key.dtype)
    (k_view, k_strides, _), (v_view, v_strides, v_off) = mixed_side_views(kv_cache, layout)
    # NVFP4 side bases are page starts plus a 16-byte aligned side offset (in bytes: NVFP4 views are uint8).
    align = min(_pow2_divisor(kv_cache.stride(0)), _pow2_divisor(layout.side_offsets[1]))
    # The launch shape of the costlier side's encoding (the tile sizes differ only by that).
    tile_mode = int(fmt.value if fmt.key is KVQuantMode.NONE else fmt.key)
    block = launch_config or _launch_config(int(num_tokens).bit_length(), num_heads, head_size, tile_mode,
                                            key.element_size())
    _launch(key, value, k_view, v_view, slot_mapping, k_scale, v_scale, num_tokens, num_heads, head_size,
            int(fmt.key), True, k_strides, v_strides, 2, v_off, soft_rounding=soft_rounding, launch_config=block,
            swizzle_v=fmt.value is KVQuantMode.NVFP4 and nvfp4_v_scales_swizzled(kv_cache.shape[2], head_size),
            page_align=align, v_mode=int(fmt.value))
