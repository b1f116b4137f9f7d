"""fp8_per_token_head: the format model, the reference ops, the Triton kernels and the op contract.

The row is vLLM's (uint8 ``[head_size e4m3 bytes | float32 scale]`` per (token, head)); the scale
is ``max(amax / 448, 1e-6)`` of the row, computed by the writer. On a CPU host the Triton kernels
run under the interpreter (tiny shapes); ``-m gpu`` repeats the bit-exact and attention checks at
realistic shapes on CUDA.
"""

from __future__ import annotations

import math
import os
import struct

import pytest
import torch

if not torch.cuda.is_available():  # Triton picks interpreted vs compiled when a kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kvfuse  # noqa: E402
from kvfuse import KVCacheConfig, KVQuantMode, KVScaleGranularity  # noqa: E402
from kvfuse.kv_cache import (fp8_per_token_head_dequantize_reference,  # noqa: E402
                             fp8_per_token_head_quantize_reference, fp8_per_token_head_split, mode_of_storage_dtype,
                             read_cache_rows, row_dim_for, storage_holds)
from kvfuse.ops import checks  # noqa: E402
from kvfuse.ops import reference as ref  # noqa: E402
from kvfuse.ops import registry  # noqa: E402
from kvfuse.ops.registry import AttentionCall  # noqa: E402

from _cache_formats import SENTINEL, sentinel_cache  # noqa: E402

PTH = KVQuantMode.FP8_PER_TOKEN_HEAD
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
OPS = torch.ops.kvfuse
ONE = torch.tensor(1.0)

# Every finite e4m3fn value by code (0x7F / 0xFF are NaN).
_E4M3_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
_E4M3_VALUES = _E4M3_CODES.view(torch.float8_e4m3fn).double()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _rows_by_hand(x: torch.Tensor) -> torch.Tensor:
    """Rows computed apart from kvfuse: the scale by vLLM's formula in float32, then each value's
    e4m3 code by nearest-value search over the whole code table (ties to the even code)."""
    d = x.shape[-1]
    xf = x.float().reshape(-1, d)
    out = torch.empty(xf.shape[0], d + 4, dtype=torch.uint8)
    finite = _E4M3_VALUES.isfinite()
    values, codes = _E4M3_VALUES[finite], _E4M3_CODES[finite]
    for r in range(xf.shape[0]):
        row = xf[r]
        amax = max([abs(v) for v in row.tolist() if math.isfinite(v)] + [0.0])
        scale = torch.clamp(torch.tensor(amax, dtype=torch.float32) / 448.0, min=1e-6)
        q = (row * (1.0 / scale)).double().clamp(-448.0, 448.0)
        for i, v in enumerate(q.tolist()):
            if math.isnan(v):
                out[r, i] = 0x7F | (0x80 if math.copysign(1.0, row[i].item()) < 0 else 0)
                continue
            dist = (values - v).abs()
            best = (dist == dist.min()).nonzero().flatten()
            pick = best[0] if len(best) == 1 else best[(codes[best] & 1) == 0][0]
            code = int(codes[pick])
            if v == 0 and math.copysign(1.0, v) < 0:
                code = 0x80  # -0 keeps its sign, as the float8 conversion does
            out[r, i] = code
        out[r, d:] = torch.tensor(list(struct.pack("<f", float(scale))), dtype=torch.uint8)
    return out.reshape(*x.shape[:-1], d + 4)


def _inputs(tokens, heads, d, dtype=torch.bfloat16, seed=0, specials=True, decades=(-3, 2)):
    """K/V-like rows whose magnitudes differ by orders of magnitude from row to row (what per-row
    scales are for: 10^decades[0] .. 10^decades[1]), with NaN, +-inf and all-zero rows where ``specials``."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.logspace(*decades, tokens * heads).reshape(tokens, heads, 1)
    x = torch.randn(tokens, heads, d, generator=g) * mags[torch.randperm(tokens, generator=g)]
    if specials and tokens > 3:
        x[0, 0, 1] = float("nan")
        x[1, -1, 2] = float("inf")
        x[1, -1, 3] = float("-inf")
        x[2, 0] = 0.0
        x[3, -1, 0] = -0.0
    return x.to(dtype)


def _slots(tokens, num_slots, seed=0, pad_every=4):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:tokens].long()
    slots[::pad_every] = -1
    return slots


def _spec(heads=2, d=64, **cfg):
    return KVCacheConfig(kv_cache_dtype="fp8_per_token_head", **cfg).layer_spec("model.layers.3.attn", heads, d)


# ----------------------------------------------------------------------------- the format model


def test_name_parses_to_its_own_mode_and_vllm_layout():
    assert kvfuse.parse_kv_cache_dtype("fp8_per_token_head") is PTH
    assert kvfuse.parse_kv_cache_dtype(" FP8_Per_Token_Head ") is PTH
    assert int(PTH) == 4
    assert PTH.is_quantized and PTH.is_per_token_head and not PTH.is_fp8 and not PTH.has_static_scales
    spec = _spec(heads=3, d=80)
    assert spec.kv_quant_mode is PTH and spec.kv_cache_torch_dtype == torch.uint8
    assert spec.row_dim == 84 and spec.cache_shape(5, 16) == (5, 2, 16, 3, 84)
    assert spec.bytes_per_token == 2 * 3 * (80 + 4)  # e4m3 data plus a float32 scale per row
    assert spec.scale_granularity is KVScaleGranularity.TOKEN_HEAD and spec.scale_shape == ()
    cache = kvfuse.allocate_kv_cache(spec, 5, 16)
    assert cache.dtype == torch.uint8 and cache.shape == (5, 2, 16, 3, 84) and not cache.any()


def test_granularity_comes_with_the_dtype_not_the_config():
    # A per-head config still gives fp8_per_token_head layers their per-row scales...
    spec = _spec(kv_scale_granularity="head")
    assert spec.scale_granularity is KVScaleGranularity.TOKEN_HEAD and spec.scale_shape == ()
    # ... and skip layers the model dtype.
    skipped = KVCacheConfig("fp8_per_token_head", skip_layers=(3,)).layer_spec("model.layers.3.attn", 2, 64)
    assert skipped.kv_quant_mode is KVQuantMode.NONE and skipped.kv_cache_torch_dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"kv_scale_granularity=KVScaleGranularity.TOKEN_HEAD.*'tensor', 'head'"):
        KVCacheConfig("fp8_per_token_head", kv_scale_granularity=KVScaleGranularity.TOKEN_HEAD)
    with pytest.raises(ValueError, match=r"kv_scale_granularity='token_head' is not a scale granularity"):
        KVCacheConfig("fp8", kv_scale_granularity="token_head")


@pytest.mark.parametrize("head_size", [6, 66, 130])
def test_head_size_must_keep_the_scale_aligned(head_size):
    with pytest.raises(ValueError) as info:
        _spec(d=head_size)
    message = str(info.value)
    assert "'model.layers.3.attn'" in message and f"head_size={head_size}" in message
    assert "multiple of 4" in message


def test_uint8_holds_two_formats_so_the_mode_is_explicit():
    assert mode_of_storage_dtype(torch.uint8) is None
    assert storage_holds(torch.uint8, PTH) and storage_holds(torch.uint8, KVQuantMode.NVFP4)
    assert not storage_holds(torch.float8_e4m3fn, PTH)
    assert mode_of_storage_dtype(torch.float8_e4m3fn) is KVQuantMode.FP8_E4M3
    # Rows are stored whole: read_cache_rows with the mode reads them back as written.
    cache = sentinel_cache((3, 2, 4, 2, 68), torch.uint8)
    rows = fp8_per_token_head_quantize_reference(torch.randn(2, 2, 64))
    blocks, offsets = torch.tensor([2, 0]), torch.tensor([3, 1])
    ref.cache_write(rows, rows, cache, blocks * 4 + offsets, PTH)
    assert torch.equal(cache[2, 1, 3], rows[0]) and torch.equal(cache[0, 0, 1], rows[1])
    assert torch.equal(read_cache_rows(cache, blocks, offsets, 0, PTH), rows)


# ----------------------------------------------------------------------------- encoding math


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("head_size", [64, 80, 128])
def test_reference_rows_match_hand_computation(head_size, x_dtype):
    x = _inputs(9, 3, head_size, x_dtype, seed=head_size)
    rows = ref.encode_kv(x, ONE, PTH, torch.uint8)
    assert rows.dtype == torch.uint8 and rows.shape == (9, 3, head_size + 4)
    assert torch.equal(rows, _rows_by_hand(x))


def test_row_bytes_are_vllms_formula_and_layout():
    x = torch.tensor([[[3.0, -1.5, 0.25, 100.0] * 16]])
    rows = fp8_per_token_head_quantize_reference(x)
    # vLLM's _reshape_cache_per_token_head: scale = max(amax / QUANT_MAX, 1e-6), little-endian float32 after the data.
    scale = struct.unpack("<f", bytes(rows[0, 0, 64:].tolist()))[0]
    assert scale == float(torch.tensor(100.0) / 448.0)
    data = rows[0, 0, :64].view(torch.float8_e4m3fn).float()
    assert data[3] == 448.0 and data[0] == (torch.tensor(3.0) * (1 / torch.tensor(scale))).to(torch.float8_e4m3fn).float()
    data2, scale2 = fp8_per_token_head_split(rows)
    assert torch.equal(data2.float(), data.reshape(1, 1, 64)) and scale2.item() == scale


def test_special_values():
    x = torch.zeros(4, 1, 16)
    x[0, 0, :] = torch.linspace(-2, 2, 16)
    x[0, 0, 5] = float("nan")  # NaN: stays NaN, out of the amax
    x[1, 0, :] = 1.0
    x[1, 0, 2] = float("inf")  # inf: out of the amax, saturates to 448 * scale
    x[1, 0, 3] = float("-inf")
    x[3, 0, :] = float("nan")  # a row of NaN: scale 1e-6, every value NaN
    rows = fp8_per_token_head_quantize_reference(x)
    data, scale = fp8_per_token_head_split(rows)
    assert scale[0, 0] == float(torch.tensor(2.0) / 448) and torch.isnan(data[0, 0, 5].float())
    dec = fp8_per_token_head_dequantize_reference(rows)
    finite = torch.isfinite(x[0, 0])
    assert torch.allclose(dec[0, 0][finite], x[0, 0][finite], rtol=2 ** -4, atol=0)
    assert dec[1, 0, 2] == 448 * scale[1, 0] and dec[1, 0, 3] == -448 * scale[1, 0]
    assert dec[1, 0, 0] == 1.0
    assert scale[2, 0] == torch.tensor(1e-6, dtype=torch.float32) and not rows[2, 0, :16].any()  # zero row
    assert scale[3, 0] == torch.tensor(1e-6, dtype=torch.float32) and torch.isnan(dec[3, 0]).all()


def test_round_trip_error_bound():
    # Stated bound: e4m3 keeps 4 significant bits, so each decoded value is within 2^-4 of its
    # magnitude, or within the subnormal half-step scale * 2^-10, of the input (plus float32 noise).
    x = _inputs(64, 4, 128, torch.float32, seed=5, specials=False)
    dec = fp8_per_token_head_dequantize_reference(fp8_per_token_head_quantize_reference(x))
    scale = fp8_per_token_head_split(fp8_per_token_head_quantize_reference(x))[1].unsqueeze(-1)
    bound = torch.maximum(x.abs() * 2 ** -4, scale * 2 ** -10) * (1 + 1e-5)
    assert ((dec - x).abs() <= bound).all()


def test_per_row_scales_beat_one_static_scale_on_mixed_magnitudes():
    # Rows 10^-5 .. 10^2 in magnitude: one static e4m3 scale (amax / 448) sends the small rows into
    # e4m3's subnormals or to zero; per-row scales keep every row to e4m3's relative precision.
    # Stated: the worst row's relative error stays below 4% (it is > 30% with the static scale).
    g = torch.Generator().manual_seed(9)
    x = torch.randn(32, 2, 64, generator=g) * torch.logspace(-5, 2, 64).reshape(32, 2, 1)
    pth = fp8_per_token_head_dequantize_reference(fp8_per_token_head_quantize_reference(x))
    static = torch.tensor(x.abs().amax().item() / 448.0)
    fp8 = ref.decode_rows(ref.encode_kv(x, static, KVQuantMode.FP8_E4M3, torch.float8_e4m3fn), static,
                          KVQuantMode.FP8_E4M3)
    worst = lambda y: ((y - x).norm(dim=-1) / x.norm(dim=-1)).max().item()  # noqa: E731
    assert worst(pth) < 0.04 and worst(fp8) > 0.3, (worst(pth), worst(fp8))


# ----------------------------------------------------------------------------- Triton, bit for bit


triton = pytest.importorskip("triton")
from kvfuse.ops.triton import attention as tat  # noqa: E402
from kvfuse.ops.triton import kv_write as tkw  # noqa: E402
from kvfuse.ops.triton import rope_kv_write as trk  # noqa: E402


@pytest.mark.parametrize("head_size,tokens", [(64, 7), (80, 7), (128, 7), (80, 533)])
def test_triton_fused_write_equals_reference(head_size, tokens):
    heads, page = 3, 16
    num_blocks = -(-tokens * 2 // page)
    key = _inputs(tokens, heads, head_size, seed=1)
    value = _inputs(tokens, heads, head_size, torch.bfloat16, seed=2)
    slots = _slots(tokens, num_blocks * page, seed=3)
    want = sentinel_cache((num_blocks, 2, page, heads, head_size + 4), torch.uint8)
    got = want.clone()
    ref.encode_and_cache_write(key, value, want, slots, ONE, ONE, PTH)
    tkw.encode_and_cache_write(key, value, got, slots, ONE, ONE, int(PTH))
    assert torch.equal(got, want)
    # Padding tokens and unwritten slots keep the sentinel; every written row is the encoded row.
    written = torch.zeros(num_blocks * page, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat = got.view(num_blocks, 2, page, heads, -1).transpose(1, 2).reshape(num_blocks * page, 2, heads, -1)
    assert (flat[~written] == SENTINEL).all()
    enc = ref.encode_kv(key, ONE, PTH, torch.uint8)
    assert torch.equal(flat[slots[slots >= 0], 0], enc[slots >= 0])


def test_triton_encode_kv_and_copy_equal_reference():
    key = _inputs(11, 2, 64, torch.float16, seed=4)
    rows = tkw.encode_kv(key, ONE, int(PTH), torch.uint8)
    assert torch.equal(rows, ref.encode_kv(key, ONE, PTH, torch.uint8))
    # Non-contiguous heads (a slice of a fused QKV output), hardware-free rounding both ways.
    qkv = _inputs(11, 6, 64, seed=5)
    k = qkv[:, 2:4]
    assert torch.equal(tkw.encode_kv(k, ONE, int(PTH), torch.uint8, soft_rounding=True),
                       ref.encode_kv(k, ONE, PTH, torch.uint8))
    # cache_write of encoded rows moves them whole (the mode says they are not NVFP4 pages).
    slots = _slots(11, 40, seed=6, pad_every=3)
    want = sentinel_cache((5, 2, 8, 2, 68), torch.uint8)
    got = want.clone()
    ref.cache_write(rows, rows, want, slots, PTH)
    tkw.cache_write(rows, rows, got, slots, int(PTH))
    assert torch.equal(got, want)


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_triton_rope_write_equals_reference(neox):
    tokens, heads, d, rotary = 9, 2, 64, 32
    g = torch.Generator().manual_seed(7)
    query = torch.randn(tokens, 4, d, generator=g).bfloat16()
    key, value = _inputs(tokens, heads, d, seed=8), _inputs(tokens, heads, d, seed=9)
    cos, sin = torch.randn(64, rotary, generator=g).bfloat16(), torch.randn(64, rotary, generator=g).bfloat16()
    positions = torch.randint(0, 64, (tokens,), generator=g)
    slots = _slots(tokens, 48, seed=10)
    want = sentinel_cache((6, 2, 8, heads, d + 4), torch.uint8)
    got = want.clone()
    q_ref = ref.rope_encode_and_cache_write(query, key, value, want, slots, ONE, ONE, cos, sin, positions, rotary,
                                            neox, PTH)
    q_tri = trk.rope_encode_and_cache_write(query, key, value, got, slots, ONE, ONE, cos, sin, positions, rotary,
                                            neox, int(PTH))
    assert torch.equal(got, want) and torch.equal(q_tri, q_ref)


# ----------------------------------------------------------------------------- attention


def _attention_case(seq_lens, q_lens, hq, hkv, d, *, page=8, q_dtype=torch.float32, seed=0, poison=True):
    """A scattered cache written by the reference (unwritten bytes: NaN patterns) and the K/V it holds."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // page) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(seq_lens), max(blocks_per_seq) + 1), 10 ** 6, dtype=torch.int32)
    cache = torch.full((num_blocks, 2, page, hkv, d + 4), 0xFF if poison else 0, dtype=torch.uint8)
    i, kv = 0, []
    for b, s in enumerate(seq_lens):
        table[b, :blocks_per_seq[b]] = perm[i:i + blocks_per_seq[b]].int()
        i += blocks_per_seq[b]
        pos = torch.arange(s)
        # Keys within a decade (scores of a realistic spread), values over five decades.
        k = _inputs(s, hkv, d, q_dtype, seed=seed + 10 * b, specials=False, decades=(-1, 0))
        v = _inputs(s, hkv, d, q_dtype, seed=seed + 10 * b + 1, specials=False, decades=(-3, 2))
        ref.encode_and_cache_write(k, v, cache, table[b, pos // page].long() * page + pos % page, ONE, ONE, PTH)
        kv.append((k, v))
    query = torch.randn(sum(q_lens), hq, d, generator=g).to(q_dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    call = AttentionCall(query, cache, ONE, ONE, table, torch.tensor(seq_lens, dtype=torch.int32), qsl, PTH,
                         d ** -0.5, None)
    return call, kv


def _float64_attention(call: AttentionCall, kv_of, window=None) -> torch.Tensor:
    """Causal attention in float64 over ``kv_of(b) -> (k, v)`` [L, Hkv, D] of each sequence."""
    q_all = call.query.double()
    out = torch.zeros_like(q_all)
    qsl, lens = call.query_start_loc.tolist(), call.seq_lens.tolist()
    group = q_all.shape[1] // call.kv_cache.shape[3]
    for b, s in enumerate(lens):
        k, v = (t.double().repeat_interleave(group, dim=1) for t in kv_of(b))
        q = q_all[qsl[b]:qsl[b + 1]]
        scores = torch.einsum("qhd,khd->hqk", q, k) * call.sm_scale
        qpos = torch.arange(s - q.shape[0], s).unsqueeze(1)
        kpos = torch.arange(s).unsqueeze(0)
        allowed = (kpos <= qpos) & ((qpos - kpos) < window if window else True)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[qsl[b]:qsl[b + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
    return out


def _decoded_kv(call: AttentionCall, b: int):
    page = call.kv_cache.shape[2]
    pos = torch.arange(int(call.seq_lens[b]))
    blocks, offs = call.block_table[b, pos // page].long(), pos % page
    return tuple(fp8_per_token_head_dequantize_reference(read_cache_rows(call.kv_cache, blocks, offs, side, PTH))
                 for side in (0, 1))


SCENARIOS = {  # (seq_lens, q_lens, hq, hkv, window)
    "decode-gqa": ([19, 5, 33], [1, 1, 1], 4, 2, None),
    "prefill": ([21, 9], [21, 9], 2, 2, None),
    "mixed-window-gqa": ([26, 7], [4, 7], 6, 2, 5),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_attention_against_float64(scenario):
    seq_lens, q_lens, hq, hkv, window = SCENARIOS[scenario]
    call, kv = _attention_case(seq_lens, q_lens, hq, hkv, 64, seed=len(scenario))
    call = AttentionCall(**{**call.__dict__, "sliding_window": window})
    exact = _float64_attention(call, lambda b: _decoded_kv(call, b), window)
    # Stated tolerances, float32 queries: the reference (float32 math over the same decoded K/V) within
    # 1e-5; the Triton kernel (per-row scales folded into scores and P, fp32 dots under the interpreter,
    # tf32-free on the GPU for float32 queries) within 1e-4, both relative to the outputs' range.
    span = exact.abs().max().item()
    for name, out in (("reference", ref.paged_attention(call)), ("triton", tat.paged_attention(call))):
        err = (out.double() - exact).abs().max().item()
        assert err <= (1e-5 if name == "reference" else 1e-4) * span, (name, err, span)
    # Against the unquantized K/V: the quantization error itself. Stated bound 8% of the outputs' range:
    # each value is within 2^-4 (6.25%) of itself, and the keys' rounding moves the weights a little
    # (measured 3-4% on these inputs, whose values span five decades).
    unquantized = _float64_attention(call, lambda b: kv[b], window)
    assert (ref.paged_attention(call).double() - unquantized).abs().max().item() < 0.08 * span


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_attention_16bit_queries_and_split_kv(q_dtype):
    call, _ = _attention_case([40, 3], [1, 1], 4, 2, 80, q_dtype=q_dtype, seed=3)
    expected = ref.paged_attention(call).float()
    # Stated: within the 16-bit output rounding (bf16 3e-2, fp16 5e-3 of the range) plus P's rounding.
    tol = {torch.bfloat16: 3e-2, torch.float16: 5e-3}[q_dtype] * expected.abs().max().item()
    for splits in (None, 3):
        out = tat.paged_attention(call, num_splits=splits)
        assert out.dtype == q_dtype
        assert (out.float() - expected).abs().max().item() <= tol


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_value_scales_of_any_magnitude_stay_exact_in_16bit_dots(device):
    # P is multiplied by each value's scale divided by the tile's largest one, so that value scales
    # from 1e-5 to 1e6 in one tile neither underflow nor overflow the fp16 P @ V of a 16-bit query
    # (P * scale would reach 1e5 > fp16's 65504). The CPU interpreter computes dots in float32, so
    # only the GPU run exercises the fp16 dot. Compared with the float32 reference.
    call, _ = _attention_case([16], [1], 2, 1, 64, q_dtype=torch.float16, seed=11)
    cache = call.kv_cache
    scales = cache[..., 64:].contiguous().view(torch.float32)
    scales[:, 1] *= torch.logspace(-5, 6, scales[:, 1].numel()).reshape(scales[:, 1].shape)
    cache[..., 64:] = scales.view(torch.uint8)
    expected = ref.paged_attention(call).float()
    moved = AttentionCall(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in call.__dict__.items()})
    out = tat.paged_attention(moved).float().cpu()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=5e-3, atol=5e-3 * expected.abs().max().item())


# ----------------------------------------------------------------------------- the op contract


def test_ops_route_to_triton_reference_or_native_on_cuda_never_flashinfer():
    impls = registry.implementations()
    native = impls["native"]
    assert "does not support FP8_PER_TOKEN_HEAD" in impls["flashinfer"].covers("paged_attention", "cuda", PTH)
    # The native kernels take the fused write and decode attention, on CUDA only.
    for op in ("encode_and_cache_write", "paged_attention"):
        assert "on CUDA, not on cpu" in native.available(op, "cpu", PTH)
    for op in ("encode_kv", "cache_write"):
        reason = native.available(op, "cuda", PTH)
        assert reason is not None and f"not for {op}" in reason and "FP8_PER_TOKEN_HEAD" in reason, (op, reason)
    assert "not for rope_encode_and_cache_write" in native.available("rope_encode_and_cache_write", "cuda", PTH)
    for op in ("encode_kv", "cache_write", "encode_and_cache_write", "rope_encode_and_cache_write",
               "paged_attention"):
        assert registry.select(op, "cpu", PTH).name == "reference"
        assert impls["triton"].covers(op, "cuda", PTH) is None


def test_public_ops_write_and_attend(reference_backend):
    call, _ = _attention_case([12, 5], [3, 5], 4, 2, 64, q_dtype=torch.bfloat16, seed=2)
    key, value = _inputs(8, 2, 64, seed=12), _inputs(8, 2, 64, seed=13)
    cache = torch.zeros_like(call.kv_cache)
    slots = _slots(8, cache.shape[0] * 8, seed=14)
    OPS.encode_and_cache_write(key, value, cache, slots, ONE, ONE, int(PTH), "model.layers.0.attn")
    expected = torch.zeros_like(cache)
    OPS.cache_write(OPS.encode_kv(key, ONE, int(PTH), torch.uint8, "model.layers.0.attn"),
                    OPS.encode_kv(value, ONE, int(PTH), torch.uint8, "model.layers.0.attn"), expected, slots,
                    int(PTH), "model.layers.0.attn")
    assert torch.equal(cache, expected)
    out = OPS.paged_attention(call.query, call.kv_cache, ONE, ONE, call.block_table, call.seq_lens,
                              call.query_start_loc, int(PTH), call.sm_scale, None, "model.layers.0.attn")
    assert torch.equal(out, ref.paged_attention(call))


def test_static_scales_are_not_read_even_in_checked_mode(reference_backend):
    # k_scale / v_scale are placeholders for this mode: odd values change nothing and are not refused.
    key = _inputs(6, 2, 64, seed=15)
    odd = torch.tensor(float("nan"))
    with checks.checked():
        a = OPS.encode_kv(key, odd, int(PTH), torch.uint8, "L")
        cache = torch.zeros(2, 2, 4, 2, 68, dtype=torch.uint8)
        OPS.encode_and_cache_write(key, key, cache, torch.arange(6), torch.tensor([-1.0, 0.0]), odd, int(PTH), "L")
    assert torch.equal(a, ref.encode_kv(key, ONE, PTH, torch.uint8))
    assert torch.equal(cache[0, 0], a[:4]) and torch.equal(cache[1, 0, :2], a[4:])


def test_opcheck(reference_backend):
    key = _inputs(5, 2, 64, seed=16, specials=False)
    cache = torch.zeros(3, 2, 4, 2, 68, dtype=torch.uint8)
    slots = torch.tensor([0, 5, -1, 9, 2])
    torch.library.opcheck(OPS.encode_kv.default, (key, ONE, int(PTH), torch.uint8, "L"))
    torch.library.opcheck(OPS.encode_and_cache_write.default, (key, key, cache, slots, ONE, ONE, int(PTH), "L"))
    rows = ref.encode_kv(key, ONE, PTH, torch.uint8)
    torch.library.opcheck(OPS.cache_write.default, (rows, rows, cache, slots, int(PTH), "L"))
    query = torch.randn(3, 4, 64).bfloat16()
    torch.library.opcheck(OPS.paged_attention.default,
                          (query, cache, ONE, ONE, torch.tensor([[0, 1, 2]], dtype=torch.int32),
                           torch.tensor([10], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), int(PTH),
                           0.125, None, "L"))


def _refusal(call, *needles):
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    for needle in needles:
        assert needle in message, (needle, message)


def test_refusals_name_argument_value_and_what_is_allowed():
    key = _inputs(4, 2, 64, seed=17)
    slots = torch.arange(4)
    good = torch.zeros(2, 2, 4, 2, 68, dtype=torch.uint8)
    fp8_cache = torch.zeros(2, 2, 4, 2, 64, dtype=torch.float8_e4m3fn)
    _refusal(lambda: OPS.encode_and_cache_write(key, key, fp8_cache, slots, ONE, ONE, int(PTH), "model.layers.1.attn"),
             "model.layers.1.attn", "kv_cache.dtype=torch.float8_e4m3fn", "FP8_PER_TOKEN_HEAD", "torch.uint8")
    _refusal(lambda: OPS.encode_and_cache_write(key, key, good[..., :64], slots, ONE, ONE, int(PTH), "L"),
             "(heads, row_dim)=(2, 64)", "needs (2, 68)")
    odd = _inputs(4, 2, 66, seed=18)
    _refusal(lambda: OPS.encode_kv(odd, ONE, int(PTH), torch.uint8, "L"), "head_size=66", "multiple of 4")
    _refusal(lambda: OPS.encode_kv(key, ONE, int(PTH), torch.float8_e4m3fn, "L"),
             "cache_dtype=torch.float8_e4m3fn", "FP8_PER_TOKEN_HEAD")
    # A view whose rows are not 4-byte aligned: the float32 scales could not be stored.
    raw = torch.zeros(2 * 2 * 4 * 2 * 68 + 2, dtype=torch.uint8)
    shifted = raw[2:].view(2, 2, 4, 2, 68)
    _refusal(lambda: OPS.encode_and_cache_write(key, key, shifted, slots, ONE, ONE, int(PTH), "L"),
             "storage offset 2", "multiples of 4 bytes")
    query = torch.randn(1, 2, 64).bfloat16()
    meta = (torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32))
    _refusal(lambda: OPS.paged_attention(query, torch.zeros(2, 2, 4, 2, 72, dtype=torch.uint8), ONE, ONE, *meta,
                                         int(PTH), 0.125, None, "L"),
             "row_dim=72", "head_size=64", "FP8_PER_TOKEN_HEAD", "expected 68")


# ----------------------------------------------------------------------------- GPU, realistic shapes


def _native_or_fail():
    from kvfuse.ops import native

    reason = native.unavailable_reason("encode_and_cache_write", "cuda", int(PTH))
    if reason is not None:
        pytest.fail(f"the native per-token-head write is unavailable on this GPU host: {reason}")
    return native


@pytest.mark.gpu
@pytest.mark.parametrize("head_size,tokens", [(64, 16384), (128, 533), (128, 65536), (256, 4097), (80, 7), (72, 533), (16, 301), (8, 7)])
def test_gpu_write_bit_exact(head_size, tokens):
    native = _native_or_fail()
    heads, page = 8, 16
    num_blocks = -(-tokens * 2 // page)
    key = _inputs(tokens, heads, head_size, seed=1, specials=True).cuda()
    value = _inputs(tokens, heads, head_size, torch.float16, seed=2).cuda().bfloat16()
    slots = _slots(tokens, num_blocks * page, seed=3, pad_every=97).cuda()
    want = sentinel_cache((num_blocks, 2, page, heads, head_size + 4), torch.uint8, "cuda")
    got, soft, by_native = want.clone(), want.clone(), want.clone()
    ref.encode_and_cache_write(key, value, want, slots, ONE.cuda(), ONE.cuda(), PTH)
    tkw.encode_and_cache_write(key, value, got, slots, ONE.cuda(), ONE.cuda(), int(PTH))
    tkw.encode_and_cache_write(key, value, soft, slots, ONE.cuda(), ONE.cuda(), int(PTH), soft_rounding=True)
    assert native.per_token_head_write_refusal(key, value, by_native, slots) is None
    native.encode_and_cache_write(key, value, by_native, slots, ONE.cuda(), ONE.cuda(), int(PTH))
    assert torch.equal(got, want) and torch.equal(soft, want)
    assert torch.equal(by_native, want), "native write differs from the reference (sentinel bytes mark untouched slots)"


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("heads,tokens", [(4, 533), (3, 533), (4, 20011)])
def test_gpu_native_write_inputs_and_layouts(in_dtype, head_size, heads, tokens):
    # K and V sliced out of one fused QKV projection (strided rows), int32 slots, page 5.
    native = _native_or_fail()
    page = 5
    g = torch.Generator().manual_seed(7)
    qkv = (torch.randn(tokens, 3 * heads, head_size, generator=g) *
           torch.logspace(-2, 3, tokens).reshape(tokens, 1, 1)).to(in_dtype).cuda()
    key, value = qkv[:, heads:2 * heads], qkv[:, 2 * heads:]
    num_blocks = -(-tokens * 2 // page)
    slots = _slots(tokens, num_blocks * page, seed=8, pad_every=13).int().cuda()
    want = sentinel_cache((num_blocks, 2, page, heads, head_size + 4), torch.uint8, "cuda")
    got = want.clone()
    ref.encode_and_cache_write(key, value, want, slots, ONE.cuda(), ONE.cuda(), PTH)
    assert native.per_token_head_write_refusal(key, value, got, slots) is None
    native.encode_and_cache_write(key, value, got, slots, ONE.cuda(), ONE.cuda(), int(PTH))
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_registry_runs_native_write_and_hands_odd_layouts_to_triton(monkeypatch):
    _native_or_fail()
    monkeypatch.delenv("KVFUSE_CACHE_BACKEND", raising=False)
    monkeypatch.delenv("KVFUSE_BACKEND", raising=False)
    heads, head_size, tokens, page = 2, 68, 37, 16  # head_size 68: not a multiple of 8, Triton's
    key = _inputs(tokens, heads, head_size, seed=9).cuda()
    slots = _slots(tokens, 8 * page, seed=10).cuda()
    want = sentinel_cache((8, 2, page, heads, head_size + 4), torch.uint8, "cuda")
    got = want.clone()
    ref.encode_and_cache_write(key, key, want, slots, ONE.cuda(), ONE.cuda(), PTH)
    registry.clear_cache()
    assert registry.select("encode_and_cache_write", "cuda", PTH, tokens).name == "native"
    OPS.encode_and_cache_write(key, key, got, slots, ONE.cuda(), ONE.cuda(), int(PTH), "model.layers.0.attn")
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens", [[1] * 32, [1] * 4, [300, 1, 77]], ids=["decode32", "decode4-split", "mixed"])
def test_gpu_attention(q_lens):
    seq_lens = [max(q, 1) + 1500 + 37 * i for i, q in enumerate(q_lens)]
    call, _ = _attention_case(seq_lens, q_lens, 32, 8, 128, page=16, q_dtype=torch.bfloat16, seed=4)
    expected = ref.paged_attention(call).float()
    gpu_call = AttentionCall(**{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in call.__dict__.items()})
    out = tat.paged_attention(gpu_call).float().cpu()
    torch.testing.assert_close(out, expected, atol=3e-2 * expected.abs().max().item(), rtol=3e-2)


def test_native_entry_points_refuse_the_mode_cleanly():
    from kvfuse.ops import native

    reason = native.unavailable_reason("encode_kv", "cpu", int(PTH))
    if reason is not None:
        pytest.skip(f"native kernels unavailable: {reason}")
    assert native.mode_values()["FP8_PER_TOKEN_HEAD"] == int(PTH)
    key = _inputs(3, 2, 64, seed=19)
    with pytest.raises(ValueError, match=r"kv_quant_mode=4 \(FP8_PER_TOKEN_HEAD\) is not implemented by the native"):
        native.encode_kv(key, ONE, int(PTH), torch.uint8)
    cache = torch.zeros(2, 2, 4, 2, 68, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"FP8_PER_TOKEN_HEAD\) is not implemented by the native"):
        torch.ops.kvfuse_native.encode_and_cache_write(key, key, cache, torch.arange(3), ONE, ONE, int(PTH))
    # The per-token-head write kernel is CUDA's: on the CPU the Python entry refuses, naming the device.
    with pytest.raises(ValueError, match="key is on cpu: it runs on CUDA"):
        native.encode_and_cache_write(key, key, cache, torch.arange(3), ONE, ONE, int(PTH))
    assert not cache.any()


class _OnCuda:
    """A CPU tensor that says it is on CUDA (for the CUDA-only refusals, on any host)."""

    def __init__(self, t: torch.Tensor):
        self._t = t
        self.device = torch.device("cuda")

    def __getattr__(self, name):
        return getattr(self._t, name)


def test_native_write_refusals_name_the_layout():
    from kvfuse.ops import native

    def refusal(key, value=None, cache=None, slots=None):
        cache = torch.zeros(4, 2, 16, key.shape[1], key.shape[2] + 4, dtype=torch.uint8) if cache is None else cache
        slots = torch.arange(key.shape[0]) if slots is None else slots
        return native.per_token_head_write_refusal(_OnCuda(key), _OnCuda(key if value is None else value), cache,
                                                   slots)

    aligned = torch.zeros(8, 2, 128, dtype=torch.bfloat16)
    assert refusal(aligned) is None
    assert refusal(torch.zeros(8, 2, 80, dtype=torch.bfloat16)) is None
    assert refusal(torch.zeros(8, 2, 64, dtype=torch.float32)) is None
    for key, needle in ((torch.zeros(8, 2, 12, dtype=torch.bfloat16), "head_size=12"),
                        (torch.zeros(8, 2, 128, dtype=torch.float64), "key dtype torch.float64"),
                        (torch.zeros(8, 2, 264, dtype=torch.bfloat16), "head_size=264"),
                        (torch.zeros(8, 2, 68, dtype=torch.bfloat16)[..., :64], "16-byte aligned")):
        reason = refusal(key)
        assert reason is not None and needle in reason, (needle, reason)
    # A value laid out apart from the key (the kernel reads both through one set of strides).
    value = torch.zeros(2, 8, 128, dtype=torch.bfloat16).transpose(0, 1)
    assert "differ from value strides" in refusal(aligned, value)
    assert "slot_mapping is not contiguous" in refusal(aligned, slots=torch.arange(16)[::2])
    shifted = torch.zeros(4 * 2 * 16 * 2 * 132 + 2, dtype=torch.uint8)[2:].view(4, 2, 16, 2, 132)
    assert "4-byte aligned" in refusal(aligned, cache=shifted)

