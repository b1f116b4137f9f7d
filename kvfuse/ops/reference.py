"""Pure-PyTorch implementations of every kvfuse op: the CPU kernels and the test oracle.

They are written for clarity, not speed, and define the exact numerics every other backend
must reproduce (bit for bit for encode/store; to per-dtype tolerance for attention).
Arguments have already been validated by the op layer (``kvfuse.ops``).
"""

from __future__ import annotations

import torch

from ..kv_cache import (KVFormat, KVQuantMode, cache_layout, fp8_keep_nan_sign, fp8_max,
                        fp8_per_token_head_dequantize_reference, fp8_per_token_head_quantize_reference,
                        head_size_of_row_dim, nvfp4_dequantize_reference, nvfp4_quantize_reference,
                        read_cache_rows, write_cache_rows)
from .registry import ALL_MODES, OPS, AttentionCall, Implementation

__all__ = ["encode_kv", "cache_write", "encode_and_cache_write", "apply_rope", "rope_encode_and_cache_write",
           "paged_attention", "decode_rows", "IMPLEMENTATION"]

#: Runs everything, everywhere; chosen last (its rank), as the fallback and the oracle.
IMPLEMENTATION = Implementation(
    name="reference", module=__name__, ops=frozenset(OPS), devices=frozenset({"cpu", "cuda"}), modes=ALL_MODES,
    available=lambda op, device_type, mode: None, rank=lambda situation: 9, mixed_format_ops=frozenset(OPS),
)


def _head_scale(scale: torch.Tensor) -> torch.Tensor:
    """float32 ``scale`` shaped to broadcast over ``[..., H, D]``: ``[]`` per tensor, ``[H, 1]`` per KV head."""
    s = scale.float()
    return s.reshape(()) if s.numel() == 1 else s.reshape(-1, 1)


def encode_kv(x: torch.Tensor, scale: torch.Tensor, kv_quant_mode: int, cache_dtype: torch.dtype) -> torch.Tensor:
    """Encode ``x [T, H, D]`` into cache rows ``[T, H, row_dim]`` of ``cache_dtype``.

    - NONE: ``x.to(cache_dtype)`` (a value conversion, never a bit reinterpretation);
    - FP8: ``clamp(x / scale, -max, max)`` rounded to nearest even; NaN stays NaN;
    - NVFP4: :func:`kvfuse.kv_cache.nvfp4_quantize_reference` with ``scale`` as global scale;
    - FP8_PER_TOKEN_HEAD: :func:`kvfuse.kv_cache.fp8_per_token_head_quantize_reference` (each row
      computes and carries its own scale; ``scale`` is not read).

    ``scale`` has one element, or one per KV head (``[H]``: head ``h`` uses ``scale[h]``).
    """
    mode = KVQuantMode(kv_quant_mode)
    if mode is KVQuantMode.NONE:
        # A copy even when x already has the cache dtype: an op output must never alias its input.
        return x.to(cache_dtype, copy=True).contiguous()
    if mode.is_fp8:
        limit = fp8_max(mode)
        q = x.float() / _head_scale(scale)
        return fp8_keep_nan_sign(torch.clamp(q, -limit, limit).to(cache_dtype), x).contiguous()
    if mode.is_per_token_head:
        return fp8_per_token_head_quantize_reference(x).contiguous()
    return nvfp4_quantize_reference(x, scale).contiguous()


def decode_rows(rows: torch.Tensor, scale: torch.Tensor, kv_quant_mode: int) -> torch.Tensor:
    """Inverse of :func:`encode_kv` up to rounding: cache rows ``[..., H, row_dim]`` -> float32 ``[..., H, D]``."""
    mode = KVQuantMode(kv_quant_mode)
    if mode is KVQuantMode.NONE:
        return rows.float()
    if mode.is_fp8:
        return rows.float() * _head_scale(scale)
    if mode.is_per_token_head:
        return fp8_per_token_head_dequantize_reference(rows)
    return nvfp4_dequantize_reference(rows, scale)


def cache_write(
    key_rows: torch.Tensor,
    value_rows: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_quant_mode=None,
) -> None:
    """Scatter rows into ``kv_cache[block, 0|1, offset]`` with ``slot = block * block_size + offset``.

    NVFP4 rows are split over their page's data and block-scale regions
    (:func:`kvfuse.kv_cache.nvfp4_page_index`); a mixed format's (``kv_quant_mode`` a
    :class:`kvfuse.KVFormat` code whose sides differ) go to their side of the page
    (:func:`kvfuse.kv_cache.mixed_page_layout`). Tokens whose slot is -1 are skipped. Duplicate
    slots within one call: one of the writers wins. ``kv_quant_mode``: the layer's mode (None: a
    uint8 cache is taken for NVFP4, see :func:`kvfuse.kv_cache.read_cache_rows`).
    """
    block_size = kv_cache.shape[2]
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.any()):
        return
    slots = slots[valid]
    blocks, offsets = slots // block_size, slots % block_size
    layout = None
    if kv_quant_mode is not None:
        fmt = KVFormat.of(kv_quant_mode)
        native = key_rows.dtype if fmt.key is KVQuantMode.NONE else value_rows.dtype
        layout = cache_layout(fmt, kv_cache, head_size_of_row_dim(fmt.key, key_rows.shape[-1]), native)
    write_cache_rows(kv_cache, blocks, offsets, 0, key_rows[valid], layout)
    write_cache_rows(kv_cache, blocks, offsets, 1, value_rows[valid], layout)



def encode_and_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    kv_quant_mode: int,
) -> None:
    """The fused op's semantics: exactly :func:`encode_kv` of K and V (each in its side's mode and
    storage dtype: a mixed format's unquantized side keeps the key's dtype) followed by :func:`cache_write`."""
    fmt = KVFormat.of(kv_quant_mode)
    dtypes = [kv_cache.dtype] * 2
    if fmt.is_mixed:
        layout = cache_layout(fmt, kv_cache, key.shape[-1], key.dtype)
        dtypes = [layout.storage_dtype(0), layout.storage_dtype(1)]
    cache_write(
        encode_kv(key, k_scale, fmt.key, dtypes[0]),
        encode_kv(value, v_scale, fmt.value, dtypes[1]),
        kv_cache,
        slot_mapping,
        fmt.code,
    )


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` of float32 tensors rounded once to float32 (what ``fma.rn.f32`` computes).

    In float64 the product is exact (24 + 24 bits); the sum is rounded there, its error recovered
    exactly (TwoSum), and the float64 result moved to the neighbour with an odd last bit where the
    sum was inexact (rounding to odd). With 53 >= 24 + 2 bits, rounding that to float32 rounds the
    exact value once. inf / NaN pass through as the float64 sum has them."""
    p = a.double() * b.double()
    c64 = c.double()
    s = p + c64
    t = s - p
    err = (p - (s - t)) + (c64 - t)
    to_odd = (err != 0) & ((s.view(torch.int64) & 1) == 0) & torch.isfinite(s)
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    return torch.where(to_odd, torch.nextafter(s, toward), s).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions, rotary_dim: int,
               is_neox: bool, contract: bool = False) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` features of ``x [T, H, D]``; the result has ``x``'s dtype.

    ``cos``/``sin`` are ``[T, W]`` per token, or ``[P, W]`` tables read at ``positions [T]``, with
    ``W = rotary_dim`` (element ``i`` uses column ``i``, the table transformers builds) or
    ``W = rotary_dim / 2`` (both elements of pair ``p`` use column ``p``). The partner of element
    ``i`` and its sign (``rot``): NeoX / rotate-half pairs ``(i, i + R/2)``, ``rot = [-x2, x1]``;
    GPT-J interleaved pairs ``(2p, 2p + 1)``, ``rot = [-x1, x0, -x3, x2, ...]``. Then, in float32,

        ``y_i = x_i * cos_i + rot_i * sin_i``   (two products, one sum, each rounded to float32)

    rounded once to ``x.dtype``; features from ``rotary_dim`` on are passed through. This is what
    Inductor computes for ``x * cos + rotate_half(x) * sin`` in any of bf16/fp16/fp32 (it keeps
    fused intermediates in float32 and rounds at the store), and what the demo model computes.

    ``contract``: ``y_i = fma(x_i, cos_i, rot_i * sin_i)`` (:func:`fma_f32`), the form Triton's and
    Inductor's CUDA kernels compile the sum to, and the native CUDA kernel's. Only products that
    are not exact in float32 tell the two apart: float32 tables, or bf16 / fp16 ones below float32's
    normal range.
    """
    r, half = rotary_dim, rotary_dim // 2
    if positions is not None:
        cos, sin = cos[positions.long()], sin[positions.long()]
    cos, sin = cos.float(), sin.float()
    if cos.shape[-1] == half:
        if is_neox:
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        else:
            cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    xf = x.float()
    xr = xf[..., :r]
    if is_neox:
        rot = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    else:
        rot = torch.stack([-xr[..., 1::2], xr[..., 0::2]], dim=-1).flatten(-2)
    if contract:
        y = fma_f32(xr, cos.unsqueeze(1), rot * sin.unsqueeze(1))
    else:
        y = xr * cos.unsqueeze(1) + rot * sin.unsqueeze(1)
    return torch.cat([y, xf[..., r:]], dim=-1).to(x.dtype)


def rope_encode_and_cache_write(
    query,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions,
    rotary_dim: int,
    is_neox: bool,
    kv_quant_mode: int,
    *,
    contract: bool = False,
) -> torch.Tensor:
    """Exactly :func:`apply_rope` of the key, then :func:`encode_and_cache_write`; returns the rotated
    query (:func:`apply_rope` of ``query``), or an empty tensor when ``query`` is None.
    ``contract``: the rotation's sum as CUDA kernels contract it (see :func:`apply_rope`)."""
    encode_and_cache_write(apply_rope(key, cos, sin, positions, rotary_dim, is_neox, contract), value, kv_cache,
                           slot_mapping, k_scale, v_scale, kv_quant_mode)
    if query is None:
        return key.new_empty((0,))
    return apply_rope(query, cos, sin, positions, rotary_dim, is_neox, contract)


def paged_attention(call: AttentionCall) -> torch.Tensor:
    """Varlen causal attention over a paged cache, in float32.

    Sequence ``b`` owns query rows ``qsl[b]:qsl[b+1]`` (its ``q_len`` newest tokens) and
    ``seq_lens[b]`` cached tokens, so its query row ``i`` sits at position
    ``p = seq_lens[b] - q_len + i`` and attends to keys ``j`` with ``j <= p`` and, with a
    sliding window ``W``, ``p - j < W`` (the window counts the query's own position, as in
    transformers' ``sliding_window_overlay``). Query head ``h`` reads KV head ``h // (Hq / Hkv)``.

    Scores are ``s_j = (q . k_j) * sm_scale``; with ``logit_softcap = c > 0`` they become
    ``c * tanh(s_j / c)`` before masking (Gemma 2). ``sinks[h]``, where given, is one more logit
    in head ``h``'s softmax denominator whose value vector is zero (gpt-oss): the weights are
    ``exp(s_j) / (exp(sinks[h]) + sum_i exp(s_i))``. Rows not covered by ``query_start_loc``
    (padding) are returned as zeros.
    """
    query, kv_cache, k_scale, v_scale = call.query, call.kv_cache, call.k_scale, call.v_scale
    block_table, kv_quant_mode, sm_scale, sliding_window = (call.block_table, call.kv_quant_mode, call.sm_scale,
                                                            call.sliding_window)
    logit_softcap, sinks = call.logit_softcap, call.sinks
    num_tokens, num_q_heads, head_size = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_q_heads, head_size, dtype=torch.float32, device=query.device)
    fmt = KVFormat.of(kv_quant_mode)
    # A mixed format's unquantized side holds the model dtype, which the query has.
    layout = cache_layout(fmt, kv_cache, head_size, query.dtype)
    qsl = call.query_start_loc.tolist()
    lens = call.seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_start, q_end = qsl[b], qsl[b + 1]
        q_len = q_end - q_start
        if q_len <= 0 or seq_len <= 0:
            continue
        positions = torch.arange(seq_len, device=query.device)
        blocks = block_table[b, positions // block_size].long()
        offsets = positions % block_size
        k = decode_rows(read_cache_rows(kv_cache, blocks, offsets, 0, layout), k_scale, fmt.key)  # [L, Hkv, D]
        v = decode_rows(read_cache_rows(kv_cache, blocks, offsets, 1, layout), v_scale, fmt.value)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * sm_scale
        if logit_softcap > 0:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        q_pos = (seq_len - q_len + torch.arange(q_len, device=query.device)).unsqueeze(1)
        k_pos = positions.unsqueeze(0)
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= (q_pos - k_pos) < sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.float().reshape(num_q_heads, 1, 1).expand(num_q_heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(query.dtype)
