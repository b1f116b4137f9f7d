"""Per-KV-head static scales (vLLM's ``kv_scale_type="attn_head"``) in every op and backend.

The oracle for a per-head scale is the per-tensor path applied head by head: encoding head ``h``
with ``scale[h]`` must give exactly the bytes the one-element scale ``scale[h]`` gives for that
head alone. Triton (interpreted on CPU) and the native CPU kernels must then match the reference
bit for bit; attention is compared with a float64 computation over rows decoded head by head.
Every scale set has distinct per-head values and inputs whose heads differ in magnitude by
orders, so a kernel reading one scale for all heads fails.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton picks interpreted vs compiled when a kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kvfuse  # noqa: E402
from kvfuse import KVCacheConfig, KVQuantMode, KVScaleGranularity  # noqa: E402
from kvfuse.kv_cache import (logical_cache_rows, nvfp4_dequantize_reference, read_cache_rows, row_dim_for,  # noqa: E402
                             storage_dtype)
from kvfuse.ops import registry  # noqa: E402
from kvfuse.ops import reference as ref  # noqa: E402
from kvfuse.ops.checks import checked  # noqa: E402
from kvfuse.ops.registry import AttentionCall, Situation  # noqa: E402

from _cache_formats import SENTINEL, sentinel_cache  # noqa: E402
from test_triton_attention import DEVICE, scattered_block_table  # noqa: E402
QUANTIZED = [(KVQuantMode.FP8_E4M3, torch.float8_e4m3fn), (KVQuantMode.FP8_E5M2, torch.float8_e5m2),
             (KVQuantMode.NVFP4, torch.uint8)]
QUANT_IDS = ["e4m3", "e5m2", "nvfp4"]
# Output tolerances of attention by query dtype (the kernels round probabilities to it before P @ V).
ATTN_TOL = {torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3), torch.float32: (2e-4, 2e-4)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _assert_same_bytes(actual, expected, what):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    a, e = _bits(actual), _bits(expected)
    differ = a != e
    count = int(differ.sum())
    if count:
        first = differ.nonzero()[:4]
        pairs = [(idx, hex(int(a[tuple(idx)])), hex(int(e[tuple(idx)]))) for idx in first.tolist()]
        raise AssertionError(f"{what}: {count} bytes differ; first (index, got, expected): {pairs}")


def head_scales(mode: KVQuantMode, heads: int, which: str = "k", device=DEVICE) -> torch.Tensor:
    """Distinct positive per-head scales, spread over three orders of magnitude."""
    base = 0.02 if which == "k" else 0.05
    s = base * 4.3 ** torch.arange(heads, dtype=torch.float32)
    if mode is KVQuantMode.NVFP4:
        s = s / 6
    return s.flip(0).contiguous().to(device) if which == "v" else s.to(device)


def kv_inputs(tokens, heads, head_size, dtype=torch.bfloat16, seed=0, device=DEVICE):
    """K/V whose head ``h`` has magnitude ~ 4**h, with NaN/inf/-0 and an all-zero NVFP4 block."""
    g = torch.Generator().manual_seed(seed)
    mag = (4.0 ** torch.arange(heads, dtype=torch.float32)).view(1, heads, 1)
    key = torch.randn(tokens, heads, head_size, generator=g) * mag
    value = torch.randn(tokens, heads, head_size, generator=g) * mag.flip(1) * 3
    if tokens >= 3 and head_size >= 16:
        key[0, 0, 0] = float("nan")
        key[1, -1, 5] = float("inf")
        value[1, 0, 3] = -float("inf")
        value[2, -1, 7] = -0.0
        key[2, heads // 2, :16] = 0.0
    return key.to(dtype).to(device), value.to(dtype).to(device)


def slots_for(tokens, capacity, seed=0, device=DEVICE, slot_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed + 1)
    slots = torch.randperm(capacity, generator=g)[:tokens]
    if tokens > 2:
        slots[1::5] = -1
    return slots.to(slot_dtype).to(device)


def cache_for(tokens, heads, head_size, mode, dtype, block_size=16, device=DEVICE):
    num_blocks = (2 * tokens + block_size - 1) // block_size + 1
    return sentinel_cache((num_blocks, 2, block_size, heads, row_dim_for(mode, head_size)), dtype, device)


def assert_only_slots_written(cache, slots):
    num_blocks, _, block_size = cache.shape[:3]
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=cache.device)
    written[slots.long()[slots.long() >= 0]] = True
    rows = _bits(logical_cache_rows(cache)).view(num_blocks, 2, block_size, -1).transpose(1, 2).reshape(num_blocks * block_size, -1)
    assert bool((rows[~written] == SENTINEL).all()), "a slot outside slot_mapping (or a padding token) was written"


# ----------------------------------------------------------------------------- the reference's definition


@pytest.mark.parametrize("mode,cache_dtype", QUANTIZED, ids=QUANT_IDS)
@pytest.mark.parametrize("head_size", [64, 80])
def test_reference_per_head_is_per_tensor_head_by_head(mode, cache_dtype, head_size):
    key, _ = kv_inputs(9, 3, head_size, device="cpu")
    scale = head_scales(mode, 3, device="cpu")
    rows = ref.encode_kv(key, scale, int(mode), cache_dtype)
    for h in range(3):
        alone = ref.encode_kv(key[:, h:h + 1], scale[h].clone(), int(mode), cache_dtype)
        _assert_same_bytes(rows[:, h:h + 1], alone, f"head {h}")
        torch.testing.assert_close(ref.decode_rows(rows, scale, int(mode))[:, h].nan_to_num(),
                                   ref.decode_rows(alone, scale[h].clone(), int(mode)).squeeze(1).nan_to_num(),
                                   atol=0, rtol=0)
    # The per-head result is not what any single scale gives (so the checks below can fail).
    for h in range(3):
        assert not torch.equal(_bits(rows), _bits(ref.encode_kv(key, scale[h].clone(), int(mode), cache_dtype)))


def test_fp8_value_is_x_over_its_heads_scale():
    x = torch.tensor([[[3.0, -900.0], [3.0, -900.0]]])  # [T=1, H=2, D=2]
    scale = torch.tensor([1.0, 4.0])
    rows = ref.encode_kv(x, scale, int(KVQuantMode.FP8_E4M3), torch.float8_e4m3fn)
    assert rows.float().tolist() == [[[3.0, -448.0], [0.75, -224.0]]]


# ----------------------------------------------------------------------------- Triton (interpreted on CPU)


def _triton_write(key, value, cache, slots, k_scale, v_scale, mode, fused=True):
    from kvfuse.ops.triton import kv_write

    if fused:
        kv_write.encode_and_cache_write(key, value, cache, slots, k_scale, v_scale, int(mode))
    else:
        k_rows = kv_write.encode_kv(key, k_scale, int(mode), cache.dtype)
        v_rows = kv_write.encode_kv(value, v_scale, int(mode), cache.dtype)
        _assert_same_bytes(k_rows, ref.encode_kv(key, k_scale, int(mode), cache.dtype), "encode_kv K")
        _assert_same_bytes(v_rows, ref.encode_kv(value, v_scale, int(mode), cache.dtype), "encode_kv V")
        kv_write.cache_write(k_rows, v_rows, cache, slots)


@pytest.mark.parametrize("mode,cache_dtype", QUANTIZED, ids=QUANT_IDS)
@pytest.mark.parametrize("tokens,heads,head_size,fused", [(7, 3, 64, True), (7, 3, 80, False), (7, 2, 128, True),
                                                         (533, 2, 128, True)])
def test_triton_write_bit_exact(mode, cache_dtype, tokens, heads, head_size, fused):
    pytest.importorskip("triton")
    key, value = kv_inputs(tokens, heads, head_size, seed=tokens + head_size)
    k_scale, v_scale = head_scales(mode, heads, "k"), head_scales(mode, heads, "v")
    slots = slots_for(tokens, 2 * tokens, seed=head_size)
    expected = cache_for(tokens, heads, head_size, mode, cache_dtype)
    actual = expected.clone()
    ref.encode_and_cache_write(key, value, expected, slots, k_scale, v_scale, int(mode))
    _triton_write(key, value, actual, slots, k_scale, v_scale, mode, fused)
    _assert_same_bytes(actual, expected, f"{mode.name} T={tokens} D={head_size}")
    assert_only_slots_written(actual, slots)


@pytest.mark.parametrize("mode,cache_dtype", QUANTIZED, ids=QUANT_IDS)
def test_triton_mixed_granularity_and_strided_scale(mode, cache_dtype):
    """K per tensor with V per head, and a per-head scale that is a strided view."""
    pytest.importorskip("triton")
    key, value = kv_inputs(7, 3, 64, seed=5)
    k_scale = torch.tensor(0.37, device=DEVICE)
    v_scale = torch.stack([head_scales(mode, 3, "v"), torch.ones(3, device=DEVICE)], dim=1)[:, 0]
    assert v_scale.stride(0) == 2
    slots = slots_for(7, 14, seed=3)
    expected = cache_for(7, 3, 64, mode, cache_dtype)
    actual = expected.clone()
    ref.encode_and_cache_write(key, value, expected, slots, k_scale, v_scale, int(mode))
    _triton_write(key, value, actual, slots, k_scale, v_scale, mode)
    _assert_same_bytes(actual, expected, f"{mode.name} mixed granularity")


@pytest.mark.parametrize("mode,cache_dtype", QUANTIZED, ids=QUANT_IDS)
def test_triton_rope_write_bit_exact(mode, cache_dtype):
    pytest.importorskip("triton")
    from kvfuse.ops.triton import rope_kv_write

    tokens, heads, head_size = 7, 3, 64
    key, value = kv_inputs(tokens, heads, head_size, seed=11)
    query = torch.randn(tokens, 6, head_size).bfloat16().to(DEVICE)
    pos = torch.arange(tokens, dtype=torch.float32).unsqueeze(1)
    freqs = pos * (1.0 / 10000 ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size))
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    k_scale, v_scale = head_scales(mode, heads, "k"), head_scales(mode, heads, "v")
    slots = slots_for(tokens, 2 * tokens, seed=2)
    expected = cache_for(tokens, heads, head_size, mode, cache_dtype)
    actual = expected.clone()
    q_ref = ref.rope_encode_and_cache_write(query, key, value, expected, slots, k_scale, v_scale, cos, sin, None,
                                            head_size, True, int(mode))
    q_out = rope_kv_write.rope_encode_and_cache_write(query, key, value, actual, slots, k_scale, v_scale, cos, sin,
                                                      None, head_size, True, int(mode), fp_fusion=False)
    _assert_same_bytes(actual, expected, f"rope {mode.name}")
    _assert_same_bytes(q_out, q_ref, "rotated query")
    assert_only_slots_written(actual, slots)


# ----------------------------------------------------------------------------- native CPU


@pytest.fixture(scope="module")
def native_cpu():
    from kvfuse.ops import native

    reason = native.unavailable_reason("encode_and_cache_write", "cpu", 1)
    if reason is not None:
        pytest.skip(f"native kernels unavailable: {reason}")
    return native


@pytest.mark.parametrize("mode,cache_dtype", QUANTIZED, ids=QUANT_IDS)
@pytest.mark.parametrize("tokens,head_size", [(7, 64), (7, 80), (533, 128)])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_native_cpu_bit_exact(native_cpu, mode, cache_dtype, tokens, head_size, in_dtype):
    key, value = kv_inputs(tokens, 3, head_size, dtype=in_dtype, seed=tokens, device="cpu")
    k_scale, v_scale = head_scales(mode, 3, "k", "cpu"), head_scales(mode, 3, "v", "cpu")
    slots = slots_for(tokens, 2 * tokens, device="cpu", slot_dtype=torch.int32)
    expected = cache_for(tokens, 3, head_size, mode, cache_dtype, device="cpu")
    actual = expected.clone()
    ref.encode_and_cache_write(key, value, expected, slots, k_scale, v_scale, int(mode))
    native_cpu.encode_and_cache_write(key, value, actual, slots, k_scale, v_scale, int(mode))
    _assert_same_bytes(actual, expected, f"native {mode.name}")
    assert_only_slots_written(actual, slots)
    _assert_same_bytes(native_cpu.encode_kv(value, v_scale, int(mode), cache_dtype),
                       ref.encode_kv(value, v_scale, int(mode), cache_dtype), "native encode_kv")


def test_public_op_on_cpu_default_backend(native_cpu):
    """The eager op (native on CPU, which checks its inputs in C++) writes the reference's bytes."""
    mode = KVQuantMode.FP8_E4M3
    key, value = kv_inputs(7, 3, 64, device="cpu")
    k_scale, v_scale = head_scales(mode, 3, "k", "cpu"), head_scales(mode, 3, "v", "cpu")
    slots = slots_for(7, 14, device="cpu")
    expected = cache_for(7, 3, 64, mode, torch.float8_e4m3fn, device="cpu")
    actual = expected.clone()
    ref.encode_and_cache_write(key, value, expected, slots, k_scale, v_scale, int(mode))
    kvfuse.ops.encode_and_cache_write(key, value, actual, slots, k_scale, v_scale, mode, "model.layers.0.attn")
    _assert_same_bytes(actual, expected, "public op")


# ----------------------------------------------------------------------------- attention


def attention_float64(call: AttentionCall) -> torch.Tensor:
    """Causal varlen attention in float64 over rows decoded head by head with that head's scale."""
    mode = KVQuantMode(call.kv_quant_mode)
    cache = call.kv_cache.cpu()
    heads = cache.shape[3]

    def scale_of(s, h):
        s = s.cpu().reshape(-1)
        return s[h if s.numel() > 1 else 0]

    def decode(rows, scale):  # rows [L, row_dim] of one head
        if mode is KVQuantMode.NVFP4:
            return nvfp4_dequantize_reference(rows, scale.clone()).double()
        return rows.double() * scale.double()

    query = call.query.cpu().double()
    out = torch.zeros_like(query)
    group = query.shape[1] // heads
    qsl, lens = call.query_start_loc.tolist(), call.seq_lens.tolist()
    page = cache.shape[2]
    for b, seq_len in enumerate(lens):
        q0, q1 = qsl[b], qsl[b + 1]
        pos = torch.arange(seq_len)
        blocks = call.block_table[b].cpu()[pos // page].long()
        k_rows, v_rows = (read_cache_rows(cache, blocks, pos % page, side) for side in (0, 1))
        for h in range(query.shape[1]):
            kvh = h // group
            k = decode(k_rows[:, kvh], scale_of(call.k_scale, kvh))
            v = decode(v_rows[:, kvh], scale_of(call.v_scale, kvh))
            q = query[q0:q1, h]
            s = (q @ k.T) * call.sm_scale
            q_pos = seq_len - (q1 - q0) + torch.arange(q1 - q0)
            s = s.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))
            out[q0:q1, h] = torch.softmax(s, dim=-1) @ v
    return out


def attention_case(mode, seq_lens, q_lens, num_q_heads=6, num_kv_heads=3, head_size=64, q_dtype=torch.bfloat16,
                   page=8, seed=0, device=DEVICE):
    """A NaN-poisoned paged cache written through the reference with per-head scales."""
    g = torch.Generator().manual_seed(seed)
    num_blocks, block_table = scattered_block_table(seq_lens, page, 2, g)
    cache = torch.empty((num_blocks, 2, page, num_kv_heads, row_dim_for(mode, head_size)),
                        dtype=storage_dtype(mode, q_dtype))
    if mode is KVQuantMode.NVFP4:
        cache.fill_(0x77)
        # NaN block scales wherever nothing was written: each page side ends with its scale region.
        cache.view(num_blocks, 2, -1)[..., page * num_kv_heads * head_size // 2:] = 0x7F
    else:
        cache.view(torch.uint8).fill_(0xFF)
    k_scale, v_scale = head_scales(mode, num_kv_heads, "k", "cpu"), head_scales(mode, num_kv_heads, "v", "cpu")
    mag = (4.0 ** torch.arange(num_kv_heads, dtype=torch.float32)).view(1, -1, 1)
    for b, s in enumerate(seq_lens):
        pos = torch.arange(s)
        slots = block_table[b, pos // page].long() * page + pos % page
        k = (torch.randn(s, num_kv_heads, head_size, generator=g) * mag * 0.5).to(q_dtype)
        v = (torch.randn(s, num_kv_heads, head_size, generator=g) * mag).to(q_dtype)
        ref.encode_and_cache_write(k, v, cache, slots, k_scale, v_scale, int(mode))
    query = (torch.randn(sum(q_lens), num_q_heads, head_size, generator=g) / 4).to(q_dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    call = AttentionCall(query=query, kv_cache=cache, k_scale=k_scale, v_scale=v_scale, block_table=block_table,
                         seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=qsl,
                         kv_quant_mode=mode, sm_scale=head_size ** -0.5, sliding_window=None)
    return AttentionCall(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(call).items()})


def bf16_probability_atol(call) -> torch.Tensor:
    """Per query head: the absolute error that rounding P to bf16 (8 significant bits, as the
    kernels' bf16 P @ V dots do) can leave in an output, ``2^-8 * max |v|`` of the head's KV head,
    and at least ATTN_TOL's bf16 atol. The heads here span 4^3 in magnitude, so one atol for all
    would be either loose for the small heads or wrong for the large ones."""
    from kvfuse.ops.reference import decode_rows, read_cache_rows

    cache, mode = call.kv_cache.cpu(), KVQuantMode(call.kv_quant_mode)
    page, num_kv_heads = cache.shape[2], cache.shape[3]
    vmax = torch.zeros(num_kv_heads, dtype=torch.float64)
    for b, seq_len in enumerate(call.seq_lens.tolist()):
        pos = torch.arange(seq_len)
        blocks = call.block_table.cpu()[b, pos // page].long()
        v = decode_rows(read_cache_rows(cache, blocks, pos % page, 1, mode), call.v_scale.cpu(), mode)
        vmax = torch.maximum(vmax, v.double().abs().amax(dim=(0, 2)))
    group = call.query.shape[1] // num_kv_heads
    return torch.clamp(vmax.repeat_interleave(group) * 2.0 ** -8, min=ATTN_TOL[torch.bfloat16][0])


def _relative_error(out, expected):
    return float((out.double().cpu() - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("mode", [KVQuantMode.FP8_E4M3, KVQuantMode.FP8_E5M2, KVQuantMode.NVFP4],
                         ids=lambda m: m.name)
@pytest.mark.parametrize("seq_lens,q_lens", [([13, 21], [1, 1]), ([19, 6], [4, 6])], ids=["decode", "prefill"])
def test_attention_against_float64(mode, seq_lens, q_lens):
    pytest.importorskip("triton")
    from kvfuse.ops.triton.attention import paged_attention

    call = attention_case(mode, seq_lens, q_lens, seed=len(seq_lens) + int(mode))
    expected = attention_float64(call)
    atol, rtol = ATTN_TOL[call.query.dtype]
    # FP8 e4m3 prefill in the model dtype (fp8_dots=False): this tolerance is bf16's; FP8 dots' own
    # bound, per-head scales included, is test_quantized_prefill.py's.
    for name, out in (("reference", ref.paged_attention(call)), ("triton", paged_attention(call, fp8_dots=False))):
        assert out.shape == call.query.shape and out.dtype == call.query.dtype
        torch.testing.assert_close(out.double().cpu(), expected, atol=atol, rtol=rtol, msg=name)
    # Reading head 0's scales for every head is far outside that tolerance.
    wrong = attention_float64(AttentionCall(**{**vars(call), "k_scale": call.k_scale[:1], "v_scale": call.v_scale[:1]}))
    assert _relative_error(wrong.float(), expected) > 10 * rtol


# ----------------------------------------------------------------------------- op contract: validation, fakes


def _write_args(mode=KVQuantMode.NVFP4, heads=3, head_size=32, device="cpu"):
    key, value = kv_inputs(5, heads, head_size, seed=4, device=device)
    cache = torch.zeros((4, 2, 4, heads, row_dim_for(mode, head_size)), dtype=storage_dtype(mode, torch.bfloat16),
                        device=device)
    slots = torch.tensor([0, 3, -1, 9, 6], device=device)
    return key, value, cache, slots, head_scales(mode, heads, "k", device), head_scales(mode, heads, "v", device)


@pytest.mark.parametrize("bad,pattern", [
    (torch.ones(4), r"k_scale must be a float32 tensor with one element \(shape \[\] or \[1\]\) or one per KV head "
                    r"\(shape \[3\]\), got dtype torch.float32 shape \(4,\)"),
    (torch.ones(3, 1), r"k_scale must be .* shape \(3, 1\)"),
    (torch.ones(1, 3), r"k_scale must be .* shape \(1, 3\)"),
    (torch.ones(3, dtype=torch.float64), r"k_scale must be .*got dtype torch.float64 shape \(3,\)"),
    (torch.ones(3, dtype=torch.bfloat16), r"k_scale must be .*got dtype torch.bfloat16"),
])
@pytest.mark.parametrize("backend", [None, "reference"])
def test_bad_scale_shapes_are_refused_before_writing(bad, pattern, backend, monkeypatch):
    if backend:
        monkeypatch.setenv("KVFUSE_BACKEND", backend)
    registry.clear_cache()
    try:
        key, value, cache, slots, _, v_scale = _write_args()
        before = cache.clone()
        with pytest.raises(ValueError, match=r"encode_and_cache_write \(layer 'L'\): " + pattern):
            torch.ops.kvfuse.encode_and_cache_write(key, value, cache, slots, bad, v_scale, int(KVQuantMode.NVFP4), "L")
        assert torch.equal(cache, before)
        with pytest.raises(ValueError, match=r"encode_kv \(layer 'L'\): " + pattern.replace("k_scale", "scale")):
            torch.ops.kvfuse.encode_kv(key, bad, int(KVQuantMode.NVFP4), torch.uint8, "L")
    finally:
        registry.clear_cache()


def test_attention_refuses_scales_of_the_query_head_count(reference_backend):
    call = attention_case(KVQuantMode.FP8_E4M3, [5], [1], device="cpu")
    with pytest.raises(ValueError, match=r"paged_attention .*v_scale must be .*one per KV head \(shape \[3\]\).*"
                                         r"shape \(6,\)"):
        torch.ops.kvfuse.paged_attention(call.query, call.kv_cache, call.k_scale, torch.ones(6), call.block_table,
                                         call.seq_lens, call.query_start_loc, int(call.kv_quant_mode),
                                         call.sm_scale, None, "L")


def test_fake_accepts_per_head_and_refuses_bad_scales():
    from torch._subclasses.fake_tensor import FakeTensorMode

    key, value, cache, slots, k_scale, v_scale = _write_args()
    with FakeTensorMode(allow_non_fake_inputs=True):
        rows = torch.ops.kvfuse.encode_kv(key, k_scale, int(KVQuantMode.NVFP4), torch.uint8, "L")
        assert rows.shape == (5, 3, row_dim_for(KVQuantMode.NVFP4, 32))
        torch.ops.kvfuse.encode_and_cache_write(key, value, cache, slots, k_scale, v_scale, 3, "L")
        with pytest.raises(ValueError, match=r"v_scale must be .*shape \(2,\)"):
            torch.ops.kvfuse.encode_and_cache_write(key, value, cache, slots, k_scale, v_scale[:2], 3, "L")


def test_opcheck_with_per_head_scales(reference_backend):
    # NVFP4 (uint8) caches: opcheck compares outputs with allclose, which has no FP8 CPU kernel.
    key, value, cache, slots, k_scale, v_scale = _write_args()
    mode = int(KVQuantMode.NVFP4)
    torch.library.opcheck(torch.ops.kvfuse.encode_kv.default, (key, k_scale, mode, torch.uint8, "L"))
    torch.library.opcheck(torch.ops.kvfuse.encode_and_cache_write.default,
                          (key, value, cache, slots, k_scale, v_scale, mode, "L"))
    call = attention_case(KVQuantMode.NVFP4, [9, 4], [2, 4], head_size=32, device="cpu")
    torch.library.opcheck(torch.ops.kvfuse.paged_attention.default,
                          (call.query, call.kv_cache, call.k_scale, call.v_scale, call.block_table, call.seq_lens,
                           call.query_start_loc, mode, call.sm_scale, None, "L"))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_checked_mode_checks_every_head(bad, reference_backend):
    key, value, cache, slots, k_scale, v_scale = _write_args()
    v_scale = v_scale.clone()
    v_scale[2] = bad
    before = cache.clone()
    with checked(), pytest.raises(ValueError, match=rf"v_scale\[2\]={bad!r}; scales must be finite and > 0"):
        torch.ops.kvfuse.encode_and_cache_write(key, value, cache, slots, k_scale, v_scale, 3, "L")
    assert torch.equal(cache, before)


# ----------------------------------------------------------------------------- registry: who takes per-head scales


def test_native_cuda_and_flashinfer_decline_per_head_scales():
    fp8 = KVQuantMode.FP8_E4M3
    for name, op in (("native", "encode_and_cache_write"), ("native", "encode_kv"), ("flashinfer", "paged_attention")):
        impl = registry.implementations()[name]
        assert impl.covers(op, "cuda", fp8) is None
        assert "per KV head" in impl.covers(op, "cuda", fp8, per_head_scales=True)
    assert registry.implementations()["native"].covers("encode_kv", "cpu", fp8, per_head_scales=True) is None
    for name in ("triton", "reference"):
        assert registry.implementations()[name].covers("paged_attention", "cuda", fp8, per_head_scales=True) is None


def test_selection_passes_per_head_cuda_writes_to_triton():
    pytest.importorskip("triton")
    choice, passed_over = registry._decide(Situation("encode_and_cache_write", "cuda", KVQuantMode.FP8_E4M3, "small",
                                                     False, True))
    assert choice.name == "triton"
    assert [name for name, _ in passed_over] == ["native"]


def test_forced_flashinfer_with_per_head_scales_raises(monkeypatch):
    monkeypatch.setenv("KVFUSE_ATTENTION_BACKEND", "flashinfer")
    registry.clear_cache()
    try:
        with pytest.raises(RuntimeError, match="flashinfer.*per-tensor scales.*not one per KV head"):
            registry._decide(Situation("paged_attention", "cuda", KVQuantMode.FP8_E4M3, "any", False, True))
    finally:
        monkeypatch.delenv("KVFUSE_ATTENTION_BACKEND")
        registry.clear_cache()


def test_flashinfer_kernel_refuses_per_head_scales_itself():
    from kvfuse.ops import flashinfer

    call = attention_case(KVQuantMode.FP8_E4M3, [5], [1], device="cpu")
    with pytest.raises(ValueError, match=r"one per KV head.*FlashInfer.*triton"):
        flashinfer.paged_attention(call)


# ----------------------------------------------------------------------------- the dtype model and the layer


def test_config_and_spec_granularity():
    assert KVCacheConfig().kv_scale_granularity is KVScaleGranularity.TENSOR
    for name in ("head", "HEAD", " attn_head ", KVScaleGranularity.HEAD):
        assert KVCacheConfig("fp8", kv_scale_granularity=name).kv_scale_granularity is KVScaleGranularity.HEAD
    with pytest.raises(ValueError, match=r"kv_scale_granularity='token' is not a scale granularity; valid values are "
                                         r"'tensor', 'head', 'attn_head'"):
        KVCacheConfig(kv_scale_granularity="token")
    cfg = KVCacheConfig("nvfp4", kv_scale_granularity="head", skip_layers=("0",))
    spec = cfg.layer_spec("model.layers.1.attn", 4, 64)
    assert spec.scale_granularity is KVScaleGranularity.HEAD and spec.scale_shape == (4,)
    skipped = cfg.layer_spec("model.layers.0.attn", 4, 64)  # NONE: no scales to speak of
    assert skipped.kv_quant_mode is KVQuantMode.NONE and skipped.scale_shape == ()
    rank1 = KVCacheConfig("fp8", kv_scale_granularity="head", tp_size=2, tp_rank=1).layer_spec("m.layers.1.a", 4, 64)
    assert rank1.scale_shape == (2,)
    assert rank1.shard_scale([1.0, 2.0, 3.0, 4.0]).tolist() == [3.0, 4.0]
    assert rank1.shard_scale([5.0, 6.0]).tolist() == [5.0, 6.0]
    assert rank1.shard_scale(0.5).tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match=r"k_scale has 3 values.*one per KV head \(2 on this rank or 4 in the model\)"):
        rank1.shard_scale([1.0, 2.0, 3.0], "k_scale")


def test_layer_buffers_set_scales_and_state_dict():
    cfg = KVCacheConfig("fp8", kv_scale_granularity="head")
    attn = kvfuse.PagedAttention(8, 4, 64, "model.layers.0.attn", config=cfg)
    assert attn.k_scale.shape == (4,) and attn.k_scale.dtype == torch.float32 and bool((attn.k_scale == 1).all())
    attn.set_scales([0.5, 1.0, 2.0, 4.0], 3.0)
    assert attn.k_scale.tolist() == [0.5, 1.0, 2.0, 4.0] and attn.v_scale.tolist() == [3.0] * 4
    with pytest.raises(ValueError, match=r"v_scale=\[1.0, 0.0, 1.0, 1.0\]; scales must be finite and > 0"):
        attn.set_scales(1.0, [1.0, 0.0, 1.0, 1.0])
    assert attn.v_scale.tolist() == [3.0] * 4, "a refused call must not set either scale"
    # A per-tensor checkpoint loads into a per-head layer (every head), a per-head one as it is.
    attn.load_state_dict({"k_scale": torch.tensor(0.25), "v_scale": torch.tensor([1.0, 2.0, 3.0, 5.0])})
    assert attn.k_scale.tolist() == [0.25] * 4 and attn.v_scale.tolist() == [1.0, 2.0, 3.0, 5.0]
    # Under tensor parallelism a rank keeps its own heads of the model's scales.
    tp = kvfuse.PagedAttention(8, 4, 64, "model.layers.0.attn",
                               config=KVCacheConfig("fp8", kv_scale_granularity="head", tp_size=2, tp_rank=1))
    tp.load_state_dict({"k_scale": torch.tensor([1.0, 2.0, 3.0, 5.0]), "v_scale": torch.tensor(7.0)})
    assert tp.k_scale.tolist() == [3.0, 5.0] and tp.v_scale.tolist() == [7.0, 7.0]
    # A per-tensor layer refuses per-head values, naming the fix.
    flat = kvfuse.PagedAttention(8, 4, 64, "model.layers.0.attn", config=KVCacheConfig("fp8"))
    with pytest.raises(ValueError, match=r"k_scale has 4 values.*kv_scale_granularity='head'"):
        flat.load_state_dict({"k_scale": torch.ones(4), "v_scale": torch.tensor(1.0)})


def test_layer_eager_forward_matches_reference_with_per_head_scales(reference_backend):
    cfg = KVCacheConfig("fp8", kv_scale_granularity="head")
    attn = kvfuse.PagedAttention(6, 3, 64, "model.layers.0.attn", config=cfg)
    attn.set_scales(head_scales(KVQuantMode.FP8_E4M3, 3, "k", "cpu"), head_scales(KVQuantMode.FP8_E4M3, 3, "v", "cpu"))
    key, value = kv_inputs(5, 3, 64, seed=8, device="cpu")
    key, value = key.nan_to_num(posinf=0.0, neginf=0.0), value.nan_to_num(posinf=0.0, neginf=0.0)
    query = torch.randn(5, 6, 64).bfloat16()
    cache = kvfuse.allocate_kv_cache(attn.spec, 2, 8)
    md = kvfuse.AttentionMetadata(slot_mapping=torch.arange(5), block_table=torch.tensor([[0, 1]], dtype=torch.int32),
                                  seq_lens=torch.tensor([5], dtype=torch.int32),
                                  query_start_loc=torch.tensor([0, 5], dtype=torch.int32))
    out = attn(query, key, value, cache, md)
    expected_cache = kvfuse.allocate_kv_cache(attn.spec, 2, 8)
    ref.encode_and_cache_write(key, value, expected_cache, md.slot_mapping, attn.k_scale, attn.v_scale, 1)
    _assert_same_bytes(cache, expected_cache, "layer cache")
    call = AttentionCall(query, cache, attn.k_scale, attn.v_scale, md.block_table, md.seq_lens, md.query_start_loc,
                         KVQuantMode.FP8_E4M3, attn.sm_scale, None)
    torch.testing.assert_close(out.double(), attention_float64(call), atol=3e-2, rtol=3e-2)


# ----------------------------------------------------------------------------- GPU (run by the lead on the H100)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,cache_dtype", QUANTIZED, ids=QUANT_IDS)
@pytest.mark.parametrize("tokens", [1, 7, 533, 16384])
@pytest.mark.parametrize("head_size", [64, 80, 128])
def test_gpu_public_op_bit_exact(mode, cache_dtype, tokens, head_size):
    """On CUDA per-head writes go to Triton (native refuses them), through the eager router too."""
    key, value = kv_inputs(tokens, 8, head_size, seed=tokens, device="cuda")
    k_scale, v_scale = head_scales(mode, 8, "k", "cuda"), head_scales(mode, 8, "v", "cuda")
    slots = slots_for(tokens, 2 * tokens, device="cuda")
    expected = cache_for(tokens, 8, head_size, mode, cache_dtype, device="cuda")
    actual = expected.clone()
    ref.encode_and_cache_write(key, value, expected, slots, k_scale, v_scale, int(mode))
    assert registry.select("encode_and_cache_write", "cuda", mode, tokens, per_head_scales=True).name == "triton"
    for _ in range(2):  # the first call may install the C++ router; the second goes through it
        torch.ops.kvfuse.encode_and_cache_write(key, value, actual, slots, k_scale, v_scale, int(mode), "L")
        torch.cuda.synchronize()
        _assert_same_bytes(actual, expected, f"cuda {mode.name} T={tokens} D={head_size}")
    assert_only_slots_written(actual, slots)
    # (The native CUDA kernel's own refusal is not provoked here: a TORCH_CHECK thrown from the CUDA
    # entry points has crashed the process on the H100, see kvfuse/ops/native.py.)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [KVQuantMode.FP8_E4M3, KVQuantMode.FP8_E5M2, KVQuantMode.NVFP4], ids=lambda m: m.name)
@pytest.mark.parametrize("head_size", [64, 128])
def test_gpu_attention_against_float64(mode, head_size):
    from kvfuse.ops.triton.attention import paged_attention

    for seq_lens, q_lens in [([533, 7, 90], [1, 1, 1]), ([533, 64], [533, 64])]:
        call = attention_case(mode, seq_lens, q_lens, num_q_heads=16, num_kv_heads=4, head_size=head_size, page=16,
                              device="cuda")
        # FP8 prefill and split decode round P to bf16: with |v| up to ~200 here (E5M2 keeps
        # it), that alone moves an output by up to ~0.2, so the bound follows each head's |v|.
        # (e4m3 prefill in the model dtype: FP8 dots' own bound is test_quantized_prefill.py's.)
        out, expected = paged_attention(call, fp8_dots=False).double().cpu(), attention_float64(call)
        atol = bf16_probability_atol(call).view(1, -1, 1)
        excess = (out - expected).abs() - (atol + ATTN_TOL[torch.bfloat16][1] * expected.abs())
        assert float(excess.max()) <= 0, (
            f"{mode.name} D={head_size} q_lens={q_lens}: {int((excess > 0).sum())} outputs beyond the bound, the "
            f"worst by {float(excess.max()):.4f} at {tuple(int(i) for i in (excess == excess.max()).nonzero()[0])}")

