"""Paged attention over bf16/fp16/fp32, FP8 (e4m3/e5m2, per-token-head) and NVFP4 caches, in Triton.

One kernel serves decode, prefill and mixed batches. A program owns a *tile*: up to
``BLOCK_Q`` consecutive query tokens of one sequence times the ``GROUP`` query heads that share
one KV head, flattened into the ``M`` dimension of ``tl.dot`` (row ``m`` = token
``m // GROUP_PAD``, head ``m % GROUP_PAD``). Every K/V tile it loads is therefore reused by the
whole GQA group, and decode (one token per sequence) still feeds the tensor cores.

Math (per query row at position ``p``, keys ``j`` in the allowed set
``A(p) = {j <= p, p - j < W}``; base-2 online softmax, fp32 accumulators)::

    s_j   = (q . k_j) * sm_scale * k_scale * log2(e)
    m     = max_j s_j,  l = sum_j 2^(s_j - m),  o = v_scale * sum_j 2^(s_j - m) v_j / l

(``k_scale`` / ``v_scale``: the program's KV head's entry when the scales are per KV head. For
FP8_PER_TOKEN_HEAD caches they are each row's own scale, read beside its data, so they scale
score column ``j`` and P's column ``j`` instead: see :func:`_attend_range`.)

K/V are dequantized in registers right after the load. FP8 converts exactly to the dot dtype
(fp16 for bf16 queries where measured faster: one cvt per pair; its scale is folded into ``s``
and the output). NVFP4 turns each packed byte into two fp16 values with a few 32-bit integer
ops, a hardware e4m3x2 -> f16x2 cvt and a packed multiply by the e4m3 block scale (PTX; plain
Triton under the interpreter), exactly ``e2m1 * scale * 2^-6``; the 2^6 and the global scale are
folded into ``s`` and the output. Low and high nibbles (even and odd head-dim elements) stay in
separate tiles (``q . k = q_even . k_lo + q_odd . k_hi``), so nothing is interleaved in
registers. fp16 dots take the query through an in-kernel range check (tiles with |q| > 2^15
are scaled down, the scores scaled back).

Mixed formats (K and V sides in different modes, uint8 pages of
:func:`kvfuse.kv_cache.mixed_page_layout`) share the kernel's prologue, split-KV and reduction; their
key loop (:func:`_attend_range_mixed`) turns each side's rows into a dense tile in the dot dtype
(NVFP4 decoded element by element, in element order), so any pair of modes meets the query alike.

Split-KV: when the tiles times KV heads would not fill the GPU (small decode batches), each
tile's key range is cut into ``num_splits`` chunks; programs write a normalised partial output
and its log-sum-exp, and :func:`_paged_attention_reduce_kernel` merges them. The tile grid is
an upper bound computed from shapes only (``num_tokens // BLOCK_Q + num_seqs``) and each
program finds its sequence by binary search over ``query_start_loc``, so the launch never
reads device memory on the host and is CUDA-graph safe.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional, Union

import torch
import triton
import triton.language as tl

from ... import envs
from ...kv_cache import KVFormat, KVQuantMode, mixed_page_layout, nvfp4_v_scales_swizzled
from ..registry import AttentionCall

__all__ = ["paged_attention", "Tile", "TileTable", "DEFAULT_TILES"]

_LOG2E = 1.4426950408889634
_MODE_NONE = tl.constexpr(int(KVQuantMode.NONE))
_MODE_NVFP4 = tl.constexpr(int(KVQuantMode.NVFP4))
_MODE_FP8_PTH = tl.constexpr(int(KVQuantMode.FP8_PER_TOKEN_HEAD))
_MODE_FP8_E5M2 = tl.constexpr(int(KVQuantMode.FP8_E5M2))


@dataclass(frozen=True)
class Tile:
    """One launch configuration. ``BLOCK_M``: the tile's rows (tokens x padded GQA group);
    ``BLOCK_N``: keys per iteration; ``MAXNREG``: a register cap per thread (more resident
    programs per SM, at the risk of spills); ``KEYS_FIRST``: scores as ``(K @ q^T)^T``, the key
    tile as the dot's first operand; ``SCALE_GATHER``: NVFP4 block scales loaded per byte
    instead of broadcast in registers (see :func:`_nvfp4_tile`); ``WORD_SCALES``: NVFP4 block
    scales read through 32-bit words (see :func:`_scale_bytes`); ``PREFETCH_PAGES``: the key loop
    reads the next tile's block-table entries one iteration ahead (see :func:`_tile_pages`);
    ``LONGEST_FIRST``: query tiles run in reverse order, the causally longest first; ``TMA``: the
    new-token prefill kernel reads the query and the step's K/V through tensor descriptors (where
    their layout allows, see :func:`kvfuse.ops.triton.prefill.descriptors`); ``Q_REGISTERS``: that
    kernel holds a bf16 / fp16 query tile in registers for the score dot (Hopper's wgmma then
    reads only the key tile from shared memory; by default Triton re-reads a loaded query
    from shared memory at every key tile); ``GRID_ORDER``: the order that kernel's programs are
    dispatched in: ``tiles`` (each query head's tiles together, head after head), ``heads`` (each
    query tile's heads together, so with ``LONGEST_FIRST`` every head's longest tile goes first)
    or ``group`` (one KV head's query heads and tiles together, KV head after KV head); ``auto``
    picks by the call's size (:func:`kvfuse.ops.triton.prefill.grid_order_for`)."""

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    MAXNREG: Optional[int] = None
    KEYS_FIRST: bool = False
    SCALE_GATHER: bool = True
    WORD_SCALES: bool = False
    PREFETCH_PAGES: bool = False
    LONGEST_FIRST: bool = False
    TMA: bool = False
    Q_REGISTERS: bool = False
    GRID_ORDER: str = "tiles"

    def __post_init__(self) -> None:
        if self.GRID_ORDER not in ("tiles", "heads", "group", "auto"):
            raise ValueError(f"Tile GRID_ORDER={self.GRID_ORDER!r}: expected 'tiles', 'heads', 'group' or 'auto'")


@dataclass(frozen=True)
class TileTable:
    """Tiles by use: ``decode[key]`` / ``prefill[key]`` with keys ``small`` / ``large`` (head size
    <= 128 or not), decode also per cache format (``small_fp8``, ``small_nvfp4``) and for split
    launches (``<key>_split``, where present), prefill also for the prefix partials of a quantized
    prefill (``<key>_prefix``, where present); ``interpret`` under the CPU interpreter."""

    decode: Mapping[str, Tile]
    prefill: Mapping[str, Tile]
    interpret: Tile
    #: :mod:`.prefill`'s kernel (new keys from the step's K/V or gathered rows), ``small`` / ``large``
    #: as above, ``<size>_fp8`` for FP8 dots where present (else ``<size>``).
    new_tokens: Mapping[str, Tile] = dataclasses.field(default_factory=lambda: dict(_NEW_TOKEN_TILES))

    def __post_init__(self) -> None:
        for use, table in (("decode", self.decode), ("prefill", self.prefill), ("new_tokens", self.new_tokens)):
            missing = {"small", "large"} - set(table)
            if missing:
                raise ValueError(f"{use} tiles lack {sorted(missing)}")
            object.__setattr__(self, use, MappingProxyType(dict(table)))

    def replace(self, **fields) -> "TileTable":
        """The same table with ``fields`` set in every tile (tests and benchmarks)."""
        return TileTable({k: dataclasses.replace(t, **fields) for k, t in self.decode.items()},
                         {k: dataclasses.replace(t, **fields) for k, t in self.prefill.items()},
                         dataclasses.replace(self.interpret, **fields),
                         {k: dataclasses.replace(t, **fields) for k, t in self.new_tokens.items()})


# The new-token prefill kernel's tiles (BLOCK_M a multiple of BLOCK_N): `small` picked by
# `benchmarks/attention.py --sweep-new-tokens` on an H100 (BENCHMARKS.md, prefill); `large` untuned.
_NEW_TOKEN_TILES = {
    "small": Tile(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, PREFETCH_PAGES=True, LONGEST_FIRST=True,
                  TMA=True, Q_REGISTERS=True, GRID_ORDER="auto"),
    "large": Tile(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2, PREFETCH_PAGES=True, LONGEST_FIRST=True),
}


# Picked by `benchmarks/attention.py --tune` / `--focus` on an H100 (batch 64, context 4096); the
# measurements behind each entry are in BENCHMARKS.md (decode attention). Narrower K/V rows want
# more keys per iteration so each program keeps enough bytes in flight; FP8 and NVFP4 decode tiles
# are register-capped (uncapped they held 2 programs per SM); split-KV launches of FP8 keep the
# uncapped tile, which is what was measured there.
DEFAULT_TILES = TileTable(
    decode={
        "small": Tile(BLOCK_M=16, BLOCK_N=128, num_warps=4, num_stages=2),
        "small_fp8": Tile(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=3, MAXNREG=128, PREFETCH_PAGES=True),
        "small_fp8_split": Tile(BLOCK_M=16, BLOCK_N=128, num_warps=4, num_stages=2),
        "small_fp8_pth": Tile(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=3, PREFETCH_PAGES=True),
        "small_nvfp4": Tile(BLOCK_M=16, BLOCK_N=128, num_warps=4, num_stages=2, SCALE_GATHER=False, MAXNREG=128,
                            PREFETCH_PAGES=True),
        "large": Tile(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=3),
    },
    prefill={
        "small": Tile(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2, PREFETCH_PAGES=True, LONGEST_FIRST=True),
        "small_fp8_pth": Tile(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2, LONGEST_FIRST=True),
        # The prefix partials of FP8 / NVFP4 prefill (every row sees every key): more rows per tile.
        "small_prefix": Tile(BLOCK_M=256, BLOCK_N=64, num_warps=8, num_stages=3, PREFETCH_PAGES=True,
                             LONGEST_FIRST=True),
        "large": Tile(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2, LONGEST_FIRST=True),
    },
    interpret=Tile(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1, TMA=True),
)
# Split-KV aims for this many programs per SM; more splits only add reduction traffic.
_PROGRAMS_PER_SM = 4
_MAX_SPLITS = 32


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _words_inside_storage(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s bytes through aligned 32-bit words stays inside its storage: the
    data pointer is 4-byte aligned and the word holding its last byte ends within the storage."""
    if t.data_ptr() % 4:
        return False
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0) * t.element_size()
    start = t.storage_offset() * t.element_size()
    return start + -(-extent // 4) * 4 <= t.untyped_storage().nbytes()


def _row_align(offsets) -> int:
    """Largest power of two (<= 16) dividing every one of ``offsets`` (the kernels' ROW_ALIGN)."""
    align = 16
    for st in offsets:
        while st % align:
            align //= 2
    return align


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@triton.jit
def _tile_pages(bt_row_ptr, start, hi, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Block-table entries of the key tile at ``start`` (0 from ``hi`` on). A synchronous load: the
    loop pipeline copies K/V asynchronously, not the page lookup that addresses them, which is why
    PREFETCH_PAGES reads them one iteration ahead of their use (the tile in flight covers them)."""
    kpos = start + tl.arange(0, BLOCK_N)
    return tl.load(bt_row_ptr + kpos // PAGE, mask=kpos < hi, other=0)


@triton.jit
def _tile_sequence(qsl_ptr, tile, num_seqs, BLOCK: tl.constexpr):
    """(sequence, its first query row, its query count, the tile's index within it) of grid tile
    ``tile``: sequence b owns tiles ``[qsl[b] // BLOCK + b, qsl[b+1] // BLOCK + b + 1)`` (an upper
    bound from shapes only), found by binary search over ``query_start_loc``."""
    lo_b = tile * 0
    hi_b = tile * 0 + num_seqs - 1
    while lo_b < hi_b:
        mid = (lo_b + hi_b + 1) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK + mid
        lo_b = tl.where(first <= tile, mid, lo_b)
        hi_b = tl.where(first <= tile, hi_b, mid - 1)
    q_start = tl.load(qsl_ptr + lo_b)
    q_len = tl.load(qsl_ptr + lo_b + 1) - q_start
    return lo_b, q_start, q_len, tile - (q_start // BLOCK + lo_b)


@triton.jit
def _kv_offsets(blk, kpos, kvh, stride_cb, stride_cs, stride_ch, PAGE: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """int64 element offsets of K rows for positions ``kpos`` in pages ``blk`` (:func:`_tile_pages`).

    ROW_ALIGN (a power of two dividing every cache stride) is asserted to the compiler: Triton
    only infers 16-divisible strides, and rows of other widths would otherwise be read in the
    narrowest loads."""
    off = blk.to(tl.int64) * stride_cb + (kpos % PAGE).to(tl.int64) * stride_cs + kvh.to(tl.int64) * stride_ch
    return tl.multiple_of(off, ROW_ALIGN)


@triton.jit
def _softmax_update(s, allowed, m_i, l_i, MASKED: tl.constexpr):
    """Online-softmax step: returns (p, alpha, m_new, l_new); fully masked rows stay at 0."""
    if MASKED:
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no allowed key so far has m = -inf; shift by 0 instead to avoid inf - inf.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])
    if MASKED:
        p = tl.where(allowed, p, 0.0)
    alpha = tl.math.exp2(m_i - m_use)
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def _softcap(s, cap, SOFTCAP: tl.constexpr):
    """``cap * tanh(s / cap)``; ``s`` and ``cap`` both in base-2 units (the cap times log2(e)), which
    is the natural-unit cap applied before the change of base. tanh as ``1 - 2 / (e^2x + 1)``: it
    saturates to +-1 without inf/inf, and the interpreter has no tanh."""
    if SOFTCAP:
        s = cap * (1.0 - 2.0 / (tl.math.exp2(s * (2.0 * 1.4426950408889634 / cap)) + 1.0))
    return s


@triton.jit
def _allowed(kpos, kmask, qpos, window, HAS_WINDOW: tl.constexpr):
    ok = kmask[None, :] & (kpos[None, :] <= qpos[:, None])
    if HAS_WINDOW:
        ok = ok & ((qpos[:, None] - kpos[None, :]) < window)
    return ok


@triton.jit
def _attend_range(
    acc, m_i, l_i, q, qpos, lo, hi, window, qk_scale, cap,
    cache_ptr, bt_row_ptr, kvh, stride_cb, stride_ckv, stride_cs, stride_ch,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    ROW_ALIGN: tl.constexpr, KEYS_FIRST: tl.constexpr, SOFTCAP: tl.constexpr, ROW_SCALES: tl.constexpr = False,
    PREFETCH_PAGES: tl.constexpr = False,
):
    """Keys ``[lo, hi)`` of a bf16/fp16/fp32 or FP8 cache (FP8 converts exactly to DOT_DTYPE).

    KEYS_FIRST: ``q`` is passed transposed ([HEAD_PAD, BLOCK_M]) and the scores are computed as
    ``(K @ q^T)^T``, see :class:`Tile`.

    ROW_SCALES (FP8_PER_TOKEN_HEAD): each row's float32 scale follows its HEAD e4m3 bytes. The
    data keeps the FP8 path (exact conversion to DOT_DTYPE); key ``j``'s scale multiplies column
    ``j`` of the scores, and value ``j``'s scale column ``j`` of P before P @ V, divided by the
    tile's largest value scale (multiplied back into the fp32 product) so that P stays in [0, 1]
    in a 16-bit dot whatever the scales' magnitude.

    PREFETCH_PAGES: each iteration reads the next tile's block-table entries (:func:`_tile_pages`)."""
    offs_d = tl.arange(0, HEAD_PAD)
    dmask = offs_d < HEAD
    if PREFETCH_PAGES:
        ahead = _tile_pages(bt_row_ptr, lo, hi, BLOCK_N, PAGE)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kmask = kpos < hi
        if PREFETCH_PAGES:
            blk = ahead
            ahead = _tile_pages(bt_row_ptr, start + BLOCK_N, hi, BLOCK_N, PAGE)
        else:
            blk = _tile_pages(bt_row_ptr, start, hi, BLOCK_N, PAGE)
        off = _kv_offsets(blk, kpos, kvh, stride_cb, stride_cs, stride_ch, PAGE, ROW_ALIGN)
        if KEYS_FIRST:
            k = tl.load(cache_ptr + off[:, None] + offs_d[None, :], mask=kmask[:, None] & dmask[None, :],
                        other=0.0)
            s = tl.trans(tl.dot(k.to(DOT_DTYPE), q, input_precision=PRECISION)) * qk_scale
        else:
            k = tl.load(cache_ptr + off[None, :] + offs_d[:, None], mask=kmask[None, :] & dmask[:, None],
                        other=0.0)
            s = tl.dot(q, k.to(DOT_DTYPE), input_precision=PRECISION) * qk_scale
        if ROW_SCALES:
            k_rs = tl.load((cache_ptr + off + HEAD).to(tl.pointer_type(tl.float32)), mask=kmask, other=0.0)
            s = s * k_rs[None, :]
        s = _softcap(s, cap, SOFTCAP)
        allowed = _allowed(kpos, kmask, qpos, window, HAS_WINDOW)
        p, alpha, m_i, l_i = _softmax_update(s, allowed, m_i, l_i, MASKED)
        v = tl.load(cache_ptr + stride_ckv + off[:, None] + offs_d[None, :], mask=kmask[:, None] & dmask[None, :],
                    other=0.0)
        if ROW_SCALES:
            v_rs = tl.load((cache_ptr + stride_ckv + off + HEAD).to(tl.pointer_type(tl.float32)), mask=kmask,
                           other=0.0)
            v_top = tl.max(v_rs, 0)
            v_top = tl.where(v_top > 0, v_top, 1.0)
            pv = p * (v_rs / v_top)[None, :]
            acc = acc * alpha[:, None] + tl.dot(pv.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION) * v_top
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
    return acc, m_i, l_i


# E2M1 -> fp16 in PTX, four packed bytes (eight codes) per instance. Each code's magnitude bits go
# to bits 4:2 of an e4m3 byte and its sign to bit 7, which makes the e4m3 value the E2M1 value
# times 2^-6 (E2M1's subnormal 0.5 lands on e4m3's subnormal range, so no table is needed); one
# hardware cvt turns two such bytes into fp16x2, and a packed multiply applies the e4m3 block
# scale. Every step is exact: |E2M1 * scale * 2^-6| lies in [2^-16, 42] with <= 5 significant
# bits. $4: packed bytes, $5: their block-scale bytes; $0/$1: low nibbles, $2/$3: high nibbles.
_E2M1_ASM = tl.constexpr("""
{
.reg .b32 kvf_lo, kvf_hi, kvf_t;
.reg .b16 kvf_a, kvf_b, kvf_c, kvf_d, kvf_s0, kvf_s1;
.reg .b32 kvf_sc0, kvf_sc1;
shl.b32 kvf_lo, $4, 2;
and.b32 kvf_lo, kvf_lo, 0x1C1C1C1C;
shl.b32 kvf_t, $4, 4;
and.b32 kvf_t, kvf_t, 0x80808080;
or.b32 kvf_lo, kvf_lo, kvf_t;
shr.b32 kvf_hi, $4, 2;
and.b32 kvf_hi, kvf_hi, 0x1C1C1C1C;
and.b32 kvf_t, $4, 0x80808080;
or.b32 kvf_hi, kvf_hi, kvf_t;
mov.b32 {kvf_a, kvf_b}, kvf_lo;
mov.b32 {kvf_c, kvf_d}, kvf_hi;
mov.b32 {kvf_s0, kvf_s1}, $5;
cvt.rn.f16x2.e4m3x2 kvf_sc0, kvf_s0;
cvt.rn.f16x2.e4m3x2 kvf_sc1, kvf_s1;
cvt.rn.f16x2.e4m3x2 $0, kvf_a;
cvt.rn.f16x2.e4m3x2 $1, kvf_b;
cvt.rn.f16x2.e4m3x2 $2, kvf_c;
cvt.rn.f16x2.e4m3x2 $3, kvf_d;
mul.rn.f16x2 $0, $0, kvf_sc0;
mul.rn.f16x2 $1, $1, kvf_sc1;
mul.rn.f16x2 $2, $2, kvf_sc0;
mul.rn.f16x2 $3, $3, kvf_sc1;
}
""")

@triton.jit
def _e2m1_decode(packed, scale_bytes, USE_ASM: tl.constexpr):
    """Packed E2M1 bytes + per-byte e4m3 block-scale bytes (same shape, uint8) -> fp16 tensors
    (low nibbles, high nibbles), each equal to ``e2m1 * scale * 2^-6`` exactly."""
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            _E2M1_ASM, "=r,=r,=r,=r,r,r", [packed, scale_bytes],
            dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        # Same bit placement in plain Triton (the CPU interpreter cannot run PTX).
        sc = scale_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        lo8 = ((packed & 7) << 2) | ((packed & 8) << 4)
        hi8 = ((packed >> 2) & 0x1C) | (packed & 0x80)
        lo = lo8.to(tl.float8e4nv, bitcast=True).to(tl.float16) * sc
        hi = hi8.to(tl.float8e4nv, bitcast=True).to(tl.float16) * sc
    return lo, hi


@triton.jit
def _nvfp4_scale_col(j, HS, SWIZZLED: tl.constexpr, GROUP_J: tl.constexpr):
    """Offset of block scale ``j`` from its row's scale base (see :func:`_attend_range_nvfp4`):
    ``j`` for linear scales; for the 4-token interleave, ``(j // (S/4)) * H * S + 4 * (j % (S/4))``."""
    if SWIZZLED:
        return (j // GROUP_J) * HS + 4 * (j % GROUP_J)
    else:
        return j


@triton.jit
def _scale_bytes(cache_ptr, off, mask, WORD_SCALES: tl.constexpr):
    """The uint8 block scales at byte offsets ``off`` from ``cache_ptr``.

    WORD_SCALES: each through the aligned 32-bit word that holds it (the launcher checks that
    ``cache_ptr`` is 4-byte aligned and that every such word lies inside the cache's storage).
    A byte load cannot be an asynchronous copy (``cp.async`` moves 4, 8 or 16 bytes), so byte
    scale loads stay synchronous inside the key loop; word loads can join its pipeline."""
    if WORD_SCALES:
        words = tl.load(cache_ptr.to(tl.pointer_type(tl.uint32)) + (off >> 2), mask=mask, other=0)
        return ((words >> ((off & 3) * 8).to(tl.uint32)) & 0xFF).to(tl.uint8)
    else:
        return tl.load(cache_ptr + off, mask=mask, other=0)


@triton.jit
def _nvfp4_tile(data_ptr, cache_ptr, scale_off, HS, kmask, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                NB: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr, SCALE_GATHER: tl.constexpr,
                USE_ASM: tl.constexpr, SWIZZLED: tl.constexpr, WORD_SCALES: tl.constexpr):
    """Decoded (low, high) nibble tiles of BLOCK_N NVFP4 rows: ``data_ptr`` [BLOCK_N] points at
    each row's packed data, ``scale_off`` [BLOCK_N] is the byte offset from ``cache_ptr`` of its
    block-scale base (block ``j`` at :func:`_nvfp4_scale_col`); [BLOCK_N, HALF_PAD] each, or
    [HALF_PAD, BLOCK_N] when TRANSPOSED.

    SCALE_GATHER: every packed byte loads its own block-scale byte (byte e uses block e // 8; the
    repeats hit L1), which works for any head size that is a multiple of 16. Otherwise the bytes
    are loaded as [BLOCK_N, NB, 8] and the [BLOCK_N, NB, 1] scales broadcast in registers, then
    reshaped (NB must be a power of two)."""
    GROUP_J: tl.constexpr = NB // 4  # read only for interleaved scales, where NB % 4 == 0
    if SCALE_GATHER:
        offs_e = tl.arange(0, HALF_PAD)
        emask = offs_e < HALF
        col = _nvfp4_scale_col(offs_e // 8, HS, SWIZZLED, GROUP_J)
        if TRANSPOSED:
            m = kmask[None, :] & emask[:, None]
            b = tl.load(data_ptr[None, :] + offs_e[:, None], mask=m, other=0)
            s = _scale_bytes(cache_ptr, scale_off[None, :] + col[:, None], m, WORD_SCALES)
        else:
            m = kmask[:, None] & emask[None, :]
            b = tl.load(data_ptr[:, None] + offs_e[None, :], mask=m, other=0)
            s = _scale_bytes(cache_ptr, scale_off[:, None] + col[None, :], m, WORD_SCALES)
        lo, hi = _e2m1_decode(b, s, USE_ASM)
    else:
        offs_b = tl.arange(0, NB)
        offs_8 = tl.arange(0, 8)
        m = kmask[:, None, None]
        b = tl.load(data_ptr[:, None, None] + offs_b[None, :, None] * 8 + offs_8[None, None, :], mask=m, other=0)
        col = _nvfp4_scale_col(offs_b, HS, SWIZZLED, GROUP_J)
        s = _scale_bytes(cache_ptr, scale_off[:, None, None] + col[None, :, None], m, WORD_SCALES)
        lo, hi = _e2m1_decode(b, tl.broadcast_to(s, (BLOCK_N, NB, 8)), USE_ASM)
        lo = tl.reshape(lo, (BLOCK_N, HALF_PAD))
        hi = tl.reshape(hi, (BLOCK_N, HALF_PAD))
        if TRANSPOSED:
            lo = tl.trans(lo)
            hi = tl.trans(hi)
    return lo, hi


@triton.jit
def _nvfp4_v_scale_row(t, kvh, row, num_kv_heads, NB: tl.constexpr, SWIZZLE_V: tl.constexpr):
    """Offset of token ``t``'s V block scales (KV head ``kvh``, linear row index ``row``) from its
    page side's scale base: ``row * NB``, or with the 4-token interleave the group's base plus
    ``t % 4`` (its blocks then step by 4, :func:`_nvfp4_scale_col`)."""
    if SWIZZLE_V:
        return ((t - t % 4) * num_kv_heads + kvh).to(tl.int64) * NB + t % 4
    else:
        return row * NB


@triton.jit
def _attend_range_nvfp4(
    acc_e, acc_o, m_i, l_i, q_e, q_o, qpos, lo, hi, window, qk_scale, cap,
    cache_ptr, bt_row_ptr, kvh, num_kv_heads, stride_cb, stride_ckv,
    HEAD: tl.constexpr, HALF_PAD: tl.constexpr, NB: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr, SCALE_GATHER: tl.constexpr, USE_ASM: tl.constexpr, ROW_ALIGN: tl.constexpr,
    KEYS_FIRST: tl.constexpr, SOFTCAP: tl.constexpr, SWIZZLE_V: tl.constexpr, WORD_SCALES: tl.constexpr,
    PREFETCH_PAGES: tl.constexpr,
):
    """Keys ``[lo, hi)`` of an NVFP4 cache. Even and odd head-dim elements (low and high nibbles)
    stay in separate tiles: ``q . k = q_even . k_lo + q_odd . k_hi`` and ``P @ V`` fills two
    half-width accumulators, so nothing is interleaved in registers. KEYS_FIRST: as in
    :func:`_attend_range`, with ``q_e`` / ``q_o`` passed transposed.

    Page side layout (:func:`kvfuse.kv_cache.nvfp4_page_index`, H KV heads, S = HEAD / 16): row
    (t, h) has its packed data at ``(t * H + h) * HEAD/2`` and its K block scales at
    ``PAGE * H * HEAD/2 + (t * H + h) * S + j``; V scales, when SWIZZLE_V, at the same base for
    token ``4 * (t // 4)`` plus ``t % 4`` plus :func:`_nvfp4_scale_col`."""
    HALF: tl.constexpr = HEAD // 2
    scales_at = PAGE * HALF * num_kv_heads.to(tl.int64)
    hs = num_kv_heads * NB
    if PREFETCH_PAGES:
        ahead = _tile_pages(bt_row_ptr, lo, hi, BLOCK_N, PAGE)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kmask = kpos < hi
        if PREFETCH_PAGES:
            blk = ahead
            ahead = _tile_pages(bt_row_ptr, start + BLOCK_N, hi, BLOCK_N, PAGE)
        else:
            blk = _tile_pages(bt_row_ptr, start, hi, BLOCK_N, PAGE)
        page = blk.to(tl.int64) * stride_cb
        t = kpos % PAGE
        row = (t * num_kv_heads + kvh).to(tl.int64)
        k_data = cache_ptr + tl.multiple_of(page + row * HALF, ROW_ALIGN)
        k_scales = page + scales_at + row * NB
        if KEYS_FIRST:
            k_lo, k_hi = _nvfp4_tile(k_data, cache_ptr, k_scales, hs, kmask, HALF, HALF_PAD, NB, BLOCK_N, False,
                                     SCALE_GATHER, USE_ASM, False, WORD_SCALES)
            s_t = tl.dot(k_lo.to(DOT_DTYPE), q_e, input_precision=PRECISION)
            s = tl.trans(tl.dot(k_hi.to(DOT_DTYPE), q_o, s_t, input_precision=PRECISION)) * qk_scale
        else:
            k_lo, k_hi = _nvfp4_tile(k_data, cache_ptr, k_scales, hs, kmask, HALF, HALF_PAD, NB, BLOCK_N, True,
                                     SCALE_GATHER, USE_ASM, False, WORD_SCALES)
            s = tl.dot(q_e, k_lo.to(DOT_DTYPE), input_precision=PRECISION)
            s = tl.dot(q_o, k_hi.to(DOT_DTYPE), s, input_precision=PRECISION) * qk_scale
        s = _softcap(s, cap, SOFTCAP)
        allowed = _allowed(kpos, kmask, qpos, window, HAS_WINDOW)
        p, alpha, m_i, l_i = _softmax_update(s, allowed, m_i, l_i, MASKED)
        v_row = _nvfp4_v_scale_row(t, kvh, row, num_kv_heads, NB, SWIZZLE_V)
        v_lo, v_hi = _nvfp4_tile(k_data + stride_ckv, cache_ptr, stride_ckv + page + scales_at + v_row, hs, kmask,
                                 HALF, HALF_PAD, NB, BLOCK_N, False, SCALE_GATHER, USE_ASM, SWIZZLE_V, WORD_SCALES)
        p = p.to(DOT_DTYPE)
        acc_e = acc_e * alpha[:, None] + tl.dot(p, v_lo.to(DOT_DTYPE), input_precision=PRECISION)
        acc_o = acc_o * alpha[:, None] + tl.dot(p, v_hi.to(DOT_DTYPE), input_precision=PRECISION)
    return acc_e, acc_o, m_i, l_i


@triton.jit
def _mixed_side_tile(cache_ptr, side_at, t, kvh, num_kv_heads, kmask,
                     SIDE_MODE: tl.constexpr, ROW_BYTES: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr,
                     BLOCK_N: tl.constexpr, PAGE: tl.constexpr, KV_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                     TRANSPOSED: tl.constexpr, SWIZZLED: tl.constexpr, WORD_SCALES: tl.constexpr,
                     ALIGN: tl.constexpr):
    """One side's rows of a mixed-format page as a dense DOT_DTYPE tile [BLOCK_N, HEAD_PAD] (or
    [HEAD_PAD, BLOCK_N] when TRANSPOSED): token ``t[n]`` of KV head ``kvh`` of the page side that
    starts at byte ``side_at[n]`` of ``cache_ptr`` (uint8). Masked rows and padded columns are 0.

    The side is laid out as a uniform page side of SIDE_MODE (:func:`kvfuse.kv_cache.mixed_page_layout`):
    dense modes keep row (t, h) whole at ``(t * H + h) * ROW_BYTES``; NVFP4 keeps its packed data
    at ``(t * H + h) * HEAD/2`` and its block scales after all data (:func:`_attend_range_nvfp4`).
    Tile values, with the static and per-row scales left to the caller::

        NONE                            the stored KV_DTYPE value (the query's dtype)
        FP8_E4M3 / FP8_E5M2             the fp8 value
        FP8_PER_TOKEN_HEAD              the e4m3 value (the row's float32 scale follows its HEAD bytes)
        NVFP4                           e2m1 * block scale * 2^-6 (:func:`_e2m1_decode`)

    Every one of them is exact in DOT_DTYPE (fp8 and e2m1 * scale * 2^-6 carry at most 5
    significant bits). NVFP4 is decoded straight into element order: element ``d`` reads packed
    byte ``d // 2`` (its low nibble for even ``d``, high for odd; each byte is read twice, the
    second time from L1) and block scale ``d // 16``, so both sides meet the query in one layout
    whatever their modes, with no register shuffle (Triton 3.6 fails to compile a join + reshape
    of decoded nibble tiles feeding the prefill tiles' dots)."""
    row = (t * num_kv_heads + kvh).to(tl.int64)
    offs_d = tl.arange(0, HEAD_PAD)
    if SIDE_MODE == _MODE_NVFP4:
        HALF: tl.constexpr = HEAD // 2
        NB: tl.constexpr = HEAD // 16
        data = tl.multiple_of(side_at + row * HALF, ALIGN)
        scales_at = side_at + PAGE * HALF * num_kv_heads.to(tl.int64)
        if SWIZZLED:
            scale_row = scales_at + ((t - t % 4) * num_kv_heads + kvh).to(tl.int64) * NB + t % 4
        else:
            scale_row = scales_at + row * NB
        col = _nvfp4_scale_col(offs_d // 16, num_kv_heads * NB, SWIZZLED, NB // 4)
        shift = (offs_d % 2) * 4
        if TRANSPOSED:
            m = kmask[None, :] & (offs_d < HEAD)[:, None]
            packed = tl.load(cache_ptr + data[None, :] + (offs_d // 2)[:, None], mask=m, other=0)
            scale = _scale_bytes(cache_ptr, scale_row[None, :] + col[:, None], m, WORD_SCALES)
            code = (packed >> shift[:, None]) & 0xF
        else:
            m = kmask[:, None] & (offs_d < HEAD)[None, :]
            packed = tl.load(cache_ptr + data[:, None] + (offs_d // 2)[None, :], mask=m, other=0)
            scale = _scale_bytes(cache_ptr, scale_row[:, None] + col[None, :], m, WORD_SCALES)
            code = (packed >> shift[None, :]) & 0xF
        value, _ = _e2m1_decode(code.to(tl.uint8), scale, False)  # the low nibble's value
        tile = value.to(DOT_DTYPE)
    else:
        rows = cache_ptr + tl.multiple_of(side_at + row * ROW_BYTES, ALIGN)
        if SIDE_MODE == _MODE_NONE:
            rows = rows.to(tl.pointer_type(KV_DTYPE))
        if TRANSPOSED:
            x = tl.load(rows[None, :] + offs_d[:, None], mask=kmask[None, :] & (offs_d < HEAD)[:, None], other=0)
        else:
            x = tl.load(rows[:, None] + offs_d[None, :], mask=kmask[:, None] & (offs_d < HEAD)[None, :], other=0)
        if SIDE_MODE == _MODE_FP8_E5M2:
            x = x.to(tl.float8e5, bitcast=True)
        elif SIDE_MODE != _MODE_NONE:
            x = x.to(tl.float8e4nv, bitcast=True)
        tile = x.to(DOT_DTYPE)
    return tile


@triton.jit
def _mixed_row_scales(cache_ptr, side_at, t, kvh, num_kv_heads, kmask, HEAD: tl.constexpr,
                      ROW_BYTES: tl.constexpr):
    """The float32 scales of FP8_PER_TOKEN_HEAD rows (see :func:`_mixed_side_tile`); 0 where masked."""
    row = (t * num_kv_heads + kvh).to(tl.int64)
    return tl.load((cache_ptr + side_at + row * ROW_BYTES + HEAD).to(tl.pointer_type(tl.float32)), mask=kmask,
                   other=0.0)


@triton.jit
def _attend_range_mixed(
    acc, m_i, l_i, q, qpos, lo, hi, window, qk_scale, cap,
    cache_ptr, bt_row_ptr, kvh, num_kv_heads, stride_cb,
    K_MODE: tl.constexpr, V_MODE: tl.constexpr, V_SIDE_OFFSET: tl.constexpr, K_ROW_BYTES: tl.constexpr,
    V_ROW_BYTES: tl.constexpr, K_ALIGN: tl.constexpr, V_ALIGN: tl.constexpr, KV_DTYPE: tl.constexpr,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    KEYS_FIRST: tl.constexpr, SOFTCAP: tl.constexpr, SWIZZLE_V: tl.constexpr, WORD_SCALES: tl.constexpr,
    PREFETCH_PAGES: tl.constexpr,
):
    """Keys ``[lo, hi)`` of a mixed-format cache (K side in K_MODE at byte 0 of each page, V side
    in V_MODE at byte V_SIDE_OFFSET): per tile, the K and V tiles of :func:`_mixed_side_tile`,
    then the step of :func:`_attend_range`. Static scales and NVFP4's 2^6 are folded into
    ``qk_scale`` and the output by the caller; an FP8_PER_TOKEN_HEAD side's row scales enter as
    in :func:`_attend_range` (ROW_SCALES): key ``j``'s scale multiplies score column ``j``, value
    ``j``'s multiplies P's column ``j`` over the tile's largest (multiplied back after the dot),
    so that P stays in [0, 1] in a 16-bit dot.

    KEYS_FIRST: ``q`` is passed transposed and the scores are ``(K @ q^T)^T``; PREFETCH_PAGES:
    block-table entries one iteration ahead (:func:`_tile_pages`)."""
    if PREFETCH_PAGES:
        ahead = _tile_pages(bt_row_ptr, lo, hi, BLOCK_N, PAGE)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kmask = kpos < hi
        if PREFETCH_PAGES:
            blk = ahead
            ahead = _tile_pages(bt_row_ptr, start + BLOCK_N, hi, BLOCK_N, PAGE)
        else:
            blk = _tile_pages(bt_row_ptr, start, hi, BLOCK_N, PAGE)
        k_at = blk.to(tl.int64) * stride_cb
        v_at = k_at + V_SIDE_OFFSET
        t = kpos % PAGE
        if KEYS_FIRST:
            k = _mixed_side_tile(cache_ptr, k_at, t, kvh, num_kv_heads, kmask, K_MODE, K_ROW_BYTES, HEAD, HEAD_PAD,
                                 BLOCK_N, PAGE, KV_DTYPE, DOT_DTYPE, False, False, WORD_SCALES, K_ALIGN)
            s = tl.trans(tl.dot(k, q, input_precision=PRECISION)) * qk_scale
        else:
            k = _mixed_side_tile(cache_ptr, k_at, t, kvh, num_kv_heads, kmask, K_MODE, K_ROW_BYTES, HEAD, HEAD_PAD,
                                 BLOCK_N, PAGE, KV_DTYPE, DOT_DTYPE, True, False, WORD_SCALES, K_ALIGN)
            s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        if K_MODE == _MODE_FP8_PTH:
            s = s * _mixed_row_scales(cache_ptr, k_at, t, kvh, num_kv_heads, kmask, HEAD, K_ROW_BYTES)[None, :]
        s = _softcap(s, cap, SOFTCAP)
        allowed = _allowed(kpos, kmask, qpos, window, HAS_WINDOW)
        p, alpha, m_i, l_i = _softmax_update(s, allowed, m_i, l_i, MASKED)
        v = _mixed_side_tile(cache_ptr, v_at, t, kvh, num_kv_heads, kmask, V_MODE, V_ROW_BYTES, HEAD, HEAD_PAD,
                             BLOCK_N, PAGE, KV_DTYPE, DOT_DTYPE, False, SWIZZLE_V, WORD_SCALES, V_ALIGN)
        if V_MODE == _MODE_FP8_PTH:
            v_rs = _mixed_row_scales(cache_ptr, v_at, t, kvh, num_kv_heads, kmask, HEAD, V_ROW_BYTES)
            v_top = tl.max(v_rs, 0)
            v_top = tl.where(v_top > 0, v_top, 1.0)
            pv = p * (v_rs / v_top)[None, :]
            acc = acc * alpha[:, None] + tl.dot(pv.to(DOT_DTYPE), v, input_precision=PRECISION) * v_top
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
    return acc, m_i, l_i


@triton.jit
def _abs_max(x):
    return tl.max(tl.max(tl.abs(x.to(tl.float32)), 1), 0)


@triton.jit
def _fp16_safe_scale(amax):
    """Factor that brings a bf16 query tile into fp16 range for the fp16 dots of quantized caches.

    bf16 -> fp16 is exact for normal values, so only tiles with |q| > 2^15 are scaled (and then
    rounded once, to fp16's 11 bits); the caller divides the scores by the same factor."""
    return tl.where(amax > 32768.0, 32768.0 / amax, 1.0)


@triton.jit
def _paged_attention_kernel(
    q_ptr, cache_ptr, k_scale_ptr, v_scale_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, sinks_ptr,
    out_ptr, pout_ptr, plse_ptr,
    qk_scale, cap, window, num_seqs, num_splits, k_scale_stride_h, v_scale_stride_h,
    stride_qt, stride_qh, stride_cb, stride_ckv, stride_cs, stride_ch, stride_bt,
    stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    MODE: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    Q_RESCALE: tl.constexpr, SCALE_GATHER: tl.constexpr, USE_ASM: tl.constexpr, ROW_ALIGN: tl.constexpr,
    KEYS_FIRST: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, SWIZZLE_V: tl.constexpr,
    WORD_SCALES: tl.constexpr = False, PREFETCH_PAGES: tl.constexpr = False, LONGEST_FIRST: tl.constexpr = False,
    V_MODE: tl.constexpr = None, V_SIDE_OFFSET: tl.constexpr = 0, K_ROW_BYTES: tl.constexpr = 0,
    V_ROW_BYTES: tl.constexpr = 0, V_ROW_ALIGN: tl.constexpr = 16, KV_DTYPE: tl.constexpr = None,
    PREFIX_ONLY: tl.constexpr = False,
):
    """One (tile, KV head, split): attention of BLOCK_Q tokens x GROUP heads over one key range.

    PREFIX_ONLY: keys before the call's first new token only (the cached prefix, which every new
    token sees), written as a split partial (SPLIT); sequences without a prefix write nothing
    (:func:`prefix_partials`).

    V_MODE None: a uniform cache of MODE. Otherwise a mixed-format cache (uint8 pages of
    :func:`kvfuse.kv_cache.mixed_page_layout`) whose K side is MODE and V side V_MODE, the V side
    at byte V_SIDE_OFFSET of each page, rows of K_ROW_BYTES / V_ROW_BYTES bytes (ROW_ALIGN /
    V_ROW_ALIGN: the alignment of each side's row offsets), an unquantized side of KV_DTYPE."""
    MIXED: tl.constexpr = V_MODE is not None
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile = tl.program_id(0)
    if LONGEST_FIRST:
        # Causal work grows with a tile's position: the grid's last tiles start first, so that
        # the longest programs do not form the launch's tail.
        tile = tl.num_programs(0) - 1 - tile
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    b, q_start, q_len, local = _tile_sequence(qsl_ptr, tile, num_seqs, BLOCK_Q)
    if (local < 0) | (local * BLOCK_Q >= q_len):
        return
    seq_len = tl.load(seq_lens_ptr + b)
    if PREFIX_ONLY:
        if seq_len <= q_len:
            return

    offs_m = tl.arange(0, BLOCK_M)
    tok = local * BLOCK_Q + offs_m // GROUP_PAD
    head = kvh * GROUP + offs_m % GROUP_PAD
    row_ok = (tok < q_len) & (offs_m % GROUP_PAD < GROUP)
    qpos = seq_len - q_len + tok
    rows = (q_start + tok).to(tl.int64)

    # Key range of the tile, then of this split (chunks aligned to BLOCK_N).
    first_pos = seq_len - q_len + local * BLOCK_Q
    last_pos = seq_len - q_len + tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len) - 1
    hi = tl.minimum(seq_len, last_pos + 1)
    if PREFIX_ONLY:
        hi = seq_len - q_len
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
    hi = tl.maximum(hi, lo)
    chunk = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
    s_lo = tl.minimum(lo + split * chunk, hi)
    s_hi = tl.minimum(s_lo + chunk, hi)
    # Keys every row of the tile may see need no mask: [full_lo, full_hi).
    full_hi = tl.minimum(s_hi, first_pos + 1)
    full_lo = s_lo
    if HAS_WINDOW:
        full_lo = tl.maximum(s_lo, last_pos - window + 1)
    a = tl.minimum(s_lo + tl.cdiv(tl.maximum(full_lo - s_lo, 0), BLOCK_N) * BLOCK_N, s_hi)
    c = a + tl.maximum(full_hi - a, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        # The sink is a virtual key of value zero: it seeds the running max and denominator. Only
        # split 0 carries it, so the split reduction counts it once.
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")) * 1.4426950408889634
        sink = tl.where(split == 0, sink, float("-inf"))
        m_i = sink
        l_i = tl.where(sink == float("-inf"), 0.0, 1.0)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    k_scale = 1.0
    v_scale = 1.0
    if MIXED:
        # Each side's static scale where its mode has one; a per-token-head side reads its rows' own.
        if MODE != _MODE_NONE and MODE != _MODE_FP8_PTH:
            k_scale = tl.load(k_scale_ptr + kvh * k_scale_stride_h)
        if V_MODE != _MODE_NONE and V_MODE != _MODE_FP8_PTH:
            v_scale = tl.load(v_scale_ptr + kvh * v_scale_stride_h)
    elif MODE != _MODE_NONE and MODE != _MODE_FP8_PTH:
        # Per-KV-head scales: this program's head (stride 0: one scale per tensor). FP8_PER_TOKEN_HEAD
        # reads each row's scale from the cache instead (_attend_range, ROW_SCALES).
        k_scale = tl.load(k_scale_ptr + kvh * k_scale_stride_h)
        v_scale = tl.load(v_scale_ptr + kvh * v_scale_stride_h)
    qk = qk_scale * k_scale
    q_rows = q_ptr + rows[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh

    if MIXED:
        # The dense branch below, over _attend_range_mixed; written apart so that the uniform
        # branches (tuned and measured) stay as they are.
        if MODE == _MODE_NVFP4:
            qk = qk * 64.0  # decoded NVFP4 values are e2m1 * block scale * 2^-6 (_E2M1_ASM)
        if V_MODE == _MODE_NVFP4:
            v_scale = v_scale * 64.0
        offs_d = tl.arange(0, HEAD_PAD)
        qmask = row_ok[:, None] & (offs_d[None, :] < HEAD)
        q = tl.load(q_rows + offs_d[None, :], mask=qmask, other=0.0)
        if Q_RESCALE:
            qs = _fp16_safe_scale(_abs_max(q))
            q = q.to(tl.float32) * qs
            qk = qk / qs
        q = q.to(DOT_DTYPE)
        if KEYS_FIRST:
            q = tl.trans(q)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        H_KV = tl.num_programs(1)
        if HAS_WINDOW:
            acc, m_i, l_i = _attend_range_mixed(
                acc, m_i, l_i, q, qpos, s_lo, a, window, qk, cap, cache_ptr, bt_row, kvh, H_KV, stride_cb,
                MODE, V_MODE, V_SIDE_OFFSET, K_ROW_BYTES, V_ROW_BYTES, ROW_ALIGN, V_ROW_ALIGN, KV_DTYPE, HEAD,
                HEAD_PAD, BLOCK_N, PAGE, True, HAS_WINDOW, DOT_DTYPE, PRECISION, KEYS_FIRST, SOFTCAP, SWIZZLE_V,
                WORD_SCALES, PREFETCH_PAGES)
        acc, m_i, l_i = _attend_range_mixed(
            acc, m_i, l_i, q, qpos, a, c, window, qk, cap, cache_ptr, bt_row, kvh, H_KV, stride_cb,
            MODE, V_MODE, V_SIDE_OFFSET, K_ROW_BYTES, V_ROW_BYTES, ROW_ALIGN, V_ROW_ALIGN, KV_DTYPE, HEAD,
            HEAD_PAD, BLOCK_N, PAGE, False, HAS_WINDOW, DOT_DTYPE, PRECISION, KEYS_FIRST, SOFTCAP, SWIZZLE_V,
            WORD_SCALES, PREFETCH_PAGES)
        acc, m_i, l_i = _attend_range_mixed(
            acc, m_i, l_i, q, qpos, c, s_hi, window, qk, cap, cache_ptr, bt_row, kvh, H_KV, stride_cb,
            MODE, V_MODE, V_SIDE_OFFSET, K_ROW_BYTES, V_ROW_BYTES, ROW_ALIGN, V_ROW_ALIGN, KV_DTYPE, HEAD,
            HEAD_PAD, BLOCK_N, PAGE, True, HAS_WINDOW, DOT_DTYPE, PRECISION, KEYS_FIRST, SOFTCAP, SWIZZLE_V,
            WORD_SCALES, PREFETCH_PAGES)
        inv = tl.where(l_i > 0, v_scale / tl.where(l_i > 0, l_i, 1.0), 0.0)
        o = acc * inv[:, None]
        if SPLIT:
            dst = pout_ptr + split * stride_ps + rows[:, None] * stride_pt + head[:, None] * stride_ph
            tl.store(dst + offs_d[None, :], o, mask=qmask)
        else:
            dst = out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh
            tl.store(dst + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=qmask)
    elif MODE == _MODE_NVFP4:
        HALF: tl.constexpr = HEAD // 2
        HALF_PAD: tl.constexpr = HEAD_PAD // 2
        NB: tl.constexpr = HEAD // 16
        # Decoded K/V values are e2m1 * block scale * 2^-6 (_E2M1_ASM): undo that here.
        qk = qk * 64.0
        v_scale = v_scale * 64.0
        offs_e = tl.arange(0, HALF_PAD)
        qmask = row_ok[:, None] & (offs_e[None, :] < HALF)
        q_e = tl.load(q_rows + 2 * offs_e[None, :], mask=qmask, other=0.0)
        q_o = tl.load(q_rows + 2 * offs_e[None, :] + 1, mask=qmask, other=0.0)
        if Q_RESCALE:
            qs = _fp16_safe_scale(tl.maximum(_abs_max(q_e), _abs_max(q_o)))
            q_e = q_e.to(tl.float32) * qs
            q_o = q_o.to(tl.float32) * qs
            qk = qk / qs
        q_e = q_e.to(DOT_DTYPE)
        q_o = q_o.to(DOT_DTYPE)
        if KEYS_FIRST:
            q_e = tl.trans(q_e)
            q_o = tl.trans(q_o)
        acc_e = tl.zeros([BLOCK_M, HALF_PAD], tl.float32)
        acc_o = tl.zeros([BLOCK_M, HALF_PAD], tl.float32)
        if HAS_WINDOW:
            acc_e, acc_o, m_i, l_i = _attend_range_nvfp4(
                acc_e, acc_o, m_i, l_i, q_e, q_o, qpos, s_lo, a, window, qk, cap, cache_ptr, bt_row, kvh,
                tl.num_programs(1), stride_cb, stride_ckv, HEAD, HALF_PAD, NB, BLOCK_N, PAGE, True,
                HAS_WINDOW, DOT_DTYPE, PRECISION, SCALE_GATHER, USE_ASM, ROW_ALIGN, KEYS_FIRST, SOFTCAP, SWIZZLE_V,
            WORD_SCALES, PREFETCH_PAGES)
        acc_e, acc_o, m_i, l_i = _attend_range_nvfp4(
            acc_e, acc_o, m_i, l_i, q_e, q_o, qpos, a, c, window, qk, cap, cache_ptr, bt_row, kvh,
            tl.num_programs(1), stride_cb, stride_ckv, HEAD, HALF_PAD, NB, BLOCK_N, PAGE, False,
            HAS_WINDOW, DOT_DTYPE, PRECISION, SCALE_GATHER, USE_ASM, ROW_ALIGN, KEYS_FIRST, SOFTCAP, SWIZZLE_V,
            WORD_SCALES, PREFETCH_PAGES)
        acc_e, acc_o, m_i, l_i = _attend_range_nvfp4(
            acc_e, acc_o, m_i, l_i, q_e, q_o, qpos, c, s_hi, window, qk, cap, cache_ptr, bt_row, kvh,
            tl.num_programs(1), stride_cb, stride_ckv, HEAD, HALF_PAD, NB, BLOCK_N, PAGE, True,
            HAS_WINDOW, DOT_DTYPE, PRECISION, SCALE_GATHER, USE_ASM, ROW_ALIGN, KEYS_FIRST, SOFTCAP, SWIZZLE_V,
            WORD_SCALES, PREFETCH_PAGES)
        inv = tl.where(l_i > 0, v_scale / tl.where(l_i > 0, l_i, 1.0), 0.0)
        o_e = acc_e * inv[:, None]
        o_o = acc_o * inv[:, None]
        if SPLIT:
            dst = pout_ptr + split * stride_ps + rows[:, None] * stride_pt + head[:, None] * stride_ph
            tl.store(dst + 2 * offs_e[None, :], o_e, mask=qmask)
            tl.store(dst + 2 * offs_e[None, :] + 1, o_o, mask=qmask)
        else:
            dst = out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh
            tl.store(dst + 2 * offs_e[None, :], o_e.to(out_ptr.dtype.element_ty), mask=qmask)
            tl.store(dst + 2 * offs_e[None, :] + 1, o_o.to(out_ptr.dtype.element_ty), mask=qmask)
    else:
        offs_d = tl.arange(0, HEAD_PAD)
        qmask = row_ok[:, None] & (offs_d[None, :] < HEAD)
        q = tl.load(q_rows + offs_d[None, :], mask=qmask, other=0.0)
        if Q_RESCALE:
            qs = _fp16_safe_scale(_abs_max(q))
            q = q.to(tl.float32) * qs
            qk = qk / qs
        q = q.to(DOT_DTYPE)
        if KEYS_FIRST:
            q = tl.trans(q)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        if HAS_WINDOW:
            acc, m_i, l_i = _attend_range(
                acc, m_i, l_i, q, qpos, s_lo, a, window, qk, cap, cache_ptr, bt_row, kvh, stride_cb, stride_ckv,
                stride_cs, stride_ch, HEAD, HEAD_PAD, BLOCK_N, PAGE, True, HAS_WINDOW, DOT_DTYPE, PRECISION,
                ROW_ALIGN, KEYS_FIRST, SOFTCAP, MODE == _MODE_FP8_PTH, PREFETCH_PAGES)
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, qpos, a, c, window, qk, cap, cache_ptr, bt_row, kvh, stride_cb, stride_ckv,
            stride_cs, stride_ch, HEAD, HEAD_PAD, BLOCK_N, PAGE, False, HAS_WINDOW, DOT_DTYPE, PRECISION,
            ROW_ALIGN, KEYS_FIRST, SOFTCAP, MODE == _MODE_FP8_PTH, PREFETCH_PAGES)
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, qpos, c, s_hi, window, qk, cap, cache_ptr, bt_row, kvh, stride_cb, stride_ckv,
            stride_cs, stride_ch, HEAD, HEAD_PAD, BLOCK_N, PAGE, True, HAS_WINDOW, DOT_DTYPE, PRECISION,
            ROW_ALIGN, KEYS_FIRST, SOFTCAP, MODE == _MODE_FP8_PTH, PREFETCH_PAGES)
        inv = tl.where(l_i > 0, v_scale / tl.where(l_i > 0, l_i, 1.0), 0.0)
        o = acc * inv[:, None]
        if SPLIT:
            dst = pout_ptr + split * stride_ps + rows[:, None] * stride_pt + head[:, None] * stride_ph
            tl.store(dst + offs_d[None, :], o, mask=qmask)
        else:
            dst = out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh
            tl.store(dst + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=qmask)
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(plse_ptr + split * stride_ls + rows * stride_lt + head, lse, mask=row_ok)


@triton.jit
def _paged_attention_reduce_kernel(
    pout_ptr, plse_ptr, out_ptr, qsl_ptr, num_seqs, num_splits,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """Merge split partials of one (token, head): o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M).

    Writes every row of ``out``: rows outside ``query_start_loc`` (padding) get zeros.
    """
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    first = tl.load(qsl_ptr).to(tl.int64)
    end = tl.load(qsl_ptr + num_seqs).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    row = tl.zeros([SPLITS_PAD], tl.int64) + t
    smask = (offs_s < num_splits) & (row >= first) & (row < end)
    lse = tl.load(plse_ptr + offs_s * stride_ls + t * stride_lt + h, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    w = tl.where(smask, w, 0.0)
    total = tl.sum(w, 0)
    part = tl.load(pout_ptr + offs_s[:, None] * stride_ps + t * stride_pt + h * stride_ph + offs_d[None, :],
                   mask=smask[:, None] & (offs_d[None, :] < HEAD), other=0.0)
    o = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD)


_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


# Pipelined K/V tiles of a float32 query's dots take twice the shared memory of 16-bit ones: at
# BLOCK_N 128 and 2 stages that is 256 KiB, over the H100's 227 KiB (seen on the device).
_FP32_MAX_BLOCK_N = 64


def _decode_sized(num_tokens: int, num_seqs: int) -> bool:
    """Few query tokens per sequence (decode, speculative decode): decode tiles and split-KV."""
    return num_tokens <= 4 * max(num_seqs, 1)


def _pick_config(num_tokens: int, num_seqs: int, head_size: int, group_pad: int,
                 mode: Union[KVQuantMode, KVFormat], query_itemsize: int = 2, split: bool = False,
                 tiles: TileTable = DEFAULT_TILES, interpret: bool = False,
                 prefix_only: bool = False) -> tuple[Tile, bool]:
    """(tile, decode?) from shapes only: few query tokens per sequence -> decode tiles + split-KV.

    ``prefix_only``: the prefix partials of a quantized prefill (:func:`prefix_partials`), which
    take a prefill table's ``<key>_prefix`` entry where present.

    ``split``: the launch splits the context; a ``<key>_split`` entry, where present, replaces the
    key's (every decode entry has the same BLOCK_M, so the split decision does not change).

    ``mode``: the cache's mode, or a :class:`KVFormat`. No tile was tuned for mixed formats
    (K and V in different modes): their decode takes ``small_fp8`` when neither side keeps
    2-byte rows (its BLOCK_N and register cap were picked for byte-wide rows, which FP8,
    per-token-head and NVFP4 sides all read), else ``small`` (the bf16 tile); their prefill and
    large-head launches take ``small`` / ``large`` like any format."""
    decode = _decode_sized(num_tokens, num_seqs)
    if interpret:
        return tiles.interpret, decode
    size = "small" if head_size <= 128 else "large"
    key = size
    table = tiles.decode if decode else tiles.prefill
    if isinstance(mode, KVFormat) and mode.is_mixed:
        if decode and size == "small" and KVQuantMode.NONE not in mode.sides:
            key = "small_fp8"
    else:
        mode = KVFormat.of(mode).key
        if decode and size == "small" and mode is not KVQuantMode.NONE:
            key = "small_nvfp4" if mode is KVQuantMode.NVFP4 else "small_fp8"
        if size == "small" and mode is KVQuantMode.FP8_PER_TOKEN_HEAD and "small_fp8_pth" in table:
            key = "small_fp8_pth"
    if decode and split and key + "_split" in table:
        key += "_split"
    if prefix_only and not decode and key + "_prefix" in table:
        key += "_prefix"
    tile = table[key]
    if decode:
        avg_q = _next_pow2(max(1, -(-num_tokens // max(num_seqs, 1))))
        tile = dataclasses.replace(tile, BLOCK_M=max(tile.BLOCK_M, min(avg_q * group_pad, 64)))
    if query_itemsize > 2:
        tile = dataclasses.replace(tile, BLOCK_N=min(tile.BLOCK_N, _FP32_MAX_BLOCK_N))
    return tile, decode


def paged_attention(call: AttentionCall, *, tiles: TileTable = DEFAULT_TILES, num_splits: Optional[int] = None,
                    inline_asm: bool = True, quant_dot_fp16: bool = True,
                    fp8_dots: Optional[bool] = None, new_token_kernel: bool = True,
                    whole_context: Optional[bool] = None) -> torch.Tensor:
    """Varlen causal paged attention; semantics of :func:`kvfuse.ops.reference.paged_attention`.

    Rows whose sequence has no allowed key (``seq_len <= 0``, or more query tokens than cached
    positions) are zeros here, where the reference would produce NaN. Mixed formats (a
    :class:`KVFormat` whose sides differ) run :func:`_attend_range_mixed`.

    Keyword options (defaults are the measured best; tests and benchmarks vary them):
    ``tiles`` the launch configurations; ``num_splits`` split-KV chunks (default: enough programs
    to fill the GPU at small decode batches, none otherwise); ``inline_asm`` the PTX NVFP4 decode
    (else plain Triton; the CPU interpreter and mixed formats always use plain Triton); ``quant_dot_fp16`` fp16
    dots for FP8/NVFP4 caches with a bf16 query where measured faster (else bf16 dots); ``fp8_dots``
    FP8 tensor-core dots in the prefill of an FP8 e4m3 cache (:func:`.prefill.cached_new_token_prefill`;
    default: ``KVFUSE_FP8_PREFILL_DOTS``, on); ``new_token_kernel`` False: the paged kernel serves
    prefill calls too (benchmarks compare the two); ``whole_context`` whether a quantized cache's
    prefill gathers every cached key densely (True) or only the new rows, with the prefix through
    the paged kernel (False), and whether a bf16 / fp16 cache's gathers its prefix (True) or reads
    it from the pages (False); default: by the gather's size
    (:data:`.prefill.WHOLE_CONTEXT_MAX_BYTES`).
    """
    if num_splits is None and new_token_kernel:
        decode = _decode_sized(call.query.shape[0], call.block_table.shape[0])
        if call.query.shape[0] and call.block_table.shape[0]:
            if prefill.takes(call, decode):
                return prefill.new_token_prefill(call, tiles, dense_prefix=whole_context)
            if prefill.takes_cached(call, decode):
                if fp8_dots is None:
                    fp8_dots = envs.settings().fp8_prefill_dots
                return prefill.cached_new_token_prefill(call, tiles, fp8_dots=fp8_dots, inline_asm=inline_asm,
                                                        quant_dot_fp16=quant_dot_fp16, whole_context=whole_context)
    return _paged_attention(call, tiles, num_splits, inline_asm, quant_dot_fp16, prefix_only=False)


def prefix_partials(call: AttentionCall, tiles: TileTable = DEFAULT_TILES, *, inline_asm: bool = True,
                    quant_dot_fp16: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The paged kernel over each sequence's cached prefix only (keys before its first new token):
    ``(out [tokens, q_heads, head_size] float32, lse [tokens, q_heads])``, the normalised output
    (scales applied) and the base-2 log-sum-exp of the scaled scores, the sink included. Rows of
    sequences without a prefix are not written (the new-token kernel does not read them). Options
    as :func:`paged_attention`'s."""
    return _paged_attention(call, tiles, 1, inline_asm, quant_dot_fp16, prefix_only=True)


def _paged_attention(call: AttentionCall, tiles: TileTable, num_splits: Optional[int], inline_asm: bool,
                     quant_dot_fp16: bool, prefix_only: bool):
    query, kv_cache, k_scale, v_scale = call.query, call.kv_cache, call.k_scale, call.v_scale
    block_table, seq_lens, query_start_loc = call.block_table, call.seq_lens, call.query_start_loc
    fmt = KVFormat.of(call.kv_quant_mode)
    # v_mode: the V side's mode where it differs from the K side's (a mixed format), else None.
    mode, v_mode = fmt.key, (fmt.value if fmt.is_mixed else None)
    sides = fmt.sides
    sm_scale, sliding_window = call.sm_scale, call.sliding_window
    logit_softcap, sinks = call.logit_softcap, call.sinks
    interpret = envs.settings().triton_interpret
    num_tokens, num_q_heads, head_size = query.shape
    num_seqs = block_table.shape[0]
    page, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    group_pad = _next_pow2(group)
    head_pad = max(16, _next_pow2(head_size))
    if KVQuantMode.NVFP4 in sides:
        if head_size % 16:
            raise ValueError(f"head_size={head_size}: NVFP4 needs a multiple of 16 (one e4m3 scale per 16 "
                             f"elements)")
        # Each nibble tile is head_pad / 2 wide and tl.dot needs K >= 16.
        head_pad = max(32, head_pad)
    if num_tokens == 0 or num_seqs == 0:
        return torch.zeros_like(query, memory_format=torch.contiguous_format)

    cfg, decode = _pick_config(num_tokens, num_seqs, head_size, group_pad, fmt.narrowed, query.element_size(),
                               tiles=tiles, interpret=interpret, prefix_only=prefix_only)
    block_m = max(cfg.BLOCK_M, group_pad, 16)
    block_q = block_m // group_pad
    num_tiles = num_tokens // block_q + num_seqs

    if num_splits is None:
        num_splits = 1
        if decode and query.device.type == "cuda":
            programs = min(num_tokens, num_tiles) * num_kv_heads
            target = _PROGRAMS_PER_SM * _num_sms(query.device.index or 0)
            if programs < target // 2:
                num_splits = min(_MAX_SPLITS, -(-target // programs))
    elif num_splits < 1 or not (decode or prefix_only):
        raise ValueError(f"num_splits={num_splits!r}: split-KV takes a count >= 1 and decode-sized batches "
                         f"(at most 4 query tokens per sequence), got {num_tokens} tokens for {num_seqs} sequences")
    if num_splits > 1:
        cfg, decode = _pick_config(num_tokens, num_seqs, head_size, group_pad, fmt.narrowed, query.element_size(),
                                   split=True, tiles=tiles, interpret=interpret)

    out_dtype = query.dtype
    dot_dtype = _DOT_DTYPES[query.dtype]
    if (v_mode is None and mode is not KVQuantMode.NONE and query.dtype == torch.bfloat16 and quant_dot_fp16
            and (mode is KVQuantMode.NVFP4 or (decode and num_splits == 1) or prefix_only)):
        # FP8 and NVFP4 values convert to fp16 exactly and in one instruction per pair (bf16 needs a
        # longer sequence); fp16 also keeps 3 more bits of P. The query is range-checked in-kernel.
        # FP8 only where it was measured faster (BENCHMARKS.md: decode without split-KV, and the
        # prefix partials of a quantized prefill); with split-KV the bf16 dot was faster.
        dot_dtype = tl.float16
    elif (v_mode is not None and KVQuantMode.NONE not in sides and query.dtype == torch.bfloat16
          and quant_dot_fp16):
        # Mixed formats (not measured): fp16 wherever both sides are quantized, for the reasons
        # above; a bf16 side keeps bf16 dots, as its values may lie outside fp16's range.
        dot_dtype = tl.float16
    q_rescale = dot_dtype == tl.float16 and query.dtype == torch.bfloat16
    if interpret:
        dot_dtype = tl.float32  # the CPU interpreter mis-computes bf16/fp16 tl.dot (triton 3.9)
    use_asm = inline_asm and not interpret
    # Broadcasting block scales needs a power-of-two scale count per row; the gather works always.
    scale_gather = cfg.SCALE_GATHER or _next_pow2(head_size) != head_size or head_size < 32
    if v_mode is not None:
        # The mixed loop decodes NVFP4 element by element (_mixed_side_tile): no PTX, scales gathered.
        use_asm, scale_gather = False, True
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    qk_scale = float(sm_scale) * _LOG2E
    softcap = float(logit_softcap) > 0
    cap = float(logit_softcap) * _LOG2E if softcap else 1.0
    window = int(sliding_window) if sliding_window is not None else 0
    has_window = sliding_window is not None
    # FP8_PER_TOKEN_HEAD caches are uint8 (as vLLM stores them); the kernel reads their data as e4m3.
    # Mixed pages stay uint8: the kernel addresses them in bytes.
    cache = (kv_cache.view(torch.float8_e4m3fn) if mode is KVQuantMode.FP8_PER_TOKEN_HEAD and v_mode is None
             else kv_cache)
    mixed = {}
    if v_mode is None:
        # Row offsets: the strides, and for NVFP4 the packed-data row width (its page sides hold data
        # rows of head_size / 2 bytes).
        row_align = _row_align((*cache.stride()[:4], *((head_size // 2,) if mode is KVQuantMode.NVFP4 else ())))
    else:
        layout = mixed_page_layout(fmt, page, num_kv_heads, head_size, query.dtype)
        # Each side's row offsets: page stride + side offset + rows of its data width.
        side_align = [_row_align((cache.stride(0), layout.side_offsets[side],
                                  head_size // 2 if side_mode is KVQuantMode.NVFP4 else layout.row_bytes[side]))
                      for side, side_mode in enumerate(sides)]
        row_align = side_align[0]
        mixed = dict(V_MODE=int(v_mode), V_SIDE_OFFSET=layout.side_offsets[1], K_ROW_BYTES=layout.row_bytes[0],
                     V_ROW_BYTES=layout.row_bytes[1], V_ROW_ALIGN=side_align[1], KV_DTYPE=_DOT_DTYPES[query.dtype])
    swizzle_v = (v_mode or mode) is KVQuantMode.NVFP4 and nvfp4_v_scales_swizzled(page, head_size)
    word_scales = KVQuantMode.NVFP4 in sides and cfg.WORD_SCALES and _words_inside_storage(kv_cache)
    partials = num_splits > 1 or prefix_only  # written as split partials (pout, plse)
    if partials:
        pout = torch.empty((num_splits, num_tokens, num_q_heads, head_size), dtype=torch.float32,
                           device=query.device)
        plse = torch.empty((num_splits, num_tokens, num_q_heads), dtype=torch.float32, device=query.device)
        # The reduction writes ``out``; the prefix partials are the result themselves (``out``: a
        # placeholder argument the kernel does not write under SPLIT).
        out = pout[0] if prefix_only else torch.empty_like(query, memory_format=torch.contiguous_format)
    else:
        # Padding rows (outside query_start_loc) must read as zeros; no program owns them.
        out = torch.zeros_like(query, memory_format=torch.contiguous_format)
        pout = out
        plse = out
    grid = (num_tiles, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        query, cache, k_scale, v_scale, block_table, seq_lens, query_start_loc,
        sinks if sinks is not None else k_scale,  # never read without HAS_SINKS
        out, pout, plse,
        qk_scale, cap, window, num_seqs, num_splits,
        k_scale.stride(0) if k_scale.numel() > 1 else 0, v_scale.stride(0) if v_scale.numel() > 1 else 0,
        query.stride(0), query.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), block_table.stride(0),
        out.stride(0), out.stride(1),
        pout.stride(0) if partials else 0, pout.stride(1) if partials else 0, pout.stride(2) if partials else 0,
        plse.stride(0) if partials else 0, plse.stride(1) if partials else 0,
        MODE=int(mode), HEAD=head_size, HEAD_PAD=head_pad, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_Q=block_q, BLOCK_N=cfg.BLOCK_N, PAGE=page, SPLIT=partials,
        HAS_WINDOW=has_window, DOT_DTYPE=dot_dtype, PRECISION=precision,
        Q_RESCALE=q_rescale, SCALE_GATHER=scale_gather, USE_ASM=use_asm, ROW_ALIGN=row_align,
        KEYS_FIRST=cfg.KEYS_FIRST, SOFTCAP=softcap, HAS_SINKS=sinks is not None, SWIZZLE_V=swizzle_v,
        WORD_SCALES=word_scales, PREFETCH_PAGES=cfg.PREFETCH_PAGES, LONGEST_FIRST=cfg.LONGEST_FIRST,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.MAXNREG} if cfg.MAXNREG and not interpret else {}), **mixed,
        PREFIX_ONLY=prefix_only,
    )
    if prefix_only:
        return pout[0], plse[0]
    if num_splits > 1:
        _paged_attention_reduce_kernel[(num_tokens, num_q_heads)](
            pout, plse, out, query_start_loc, num_seqs, num_splits,
            pout.stride(0), pout.stride(1), pout.stride(2), plse.stride(0), plse.stride(1),
            out.stride(0), out.stride(1),
            HEAD=head_size, HEAD_PAD=head_pad, SPLITS_PAD=max(2, _next_pow2(num_splits)),
            num_warps=4 if head_size >= 128 else 2,
        )
    return out if out.dtype == out_dtype else out.to(out_dtype)


# Imported last: the new-token kernel builds on this module's tiles and key loop.
from . import prefill  # noqa: E402
