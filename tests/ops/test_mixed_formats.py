"""K and V in different formats: the format model, the page layout, the writes and the op contract.

A layer asked for ``KVCacheConfig(k_cache_dtype=..., v_cache_dtype=...)`` with two different
modes stores uint8 pages laid out by :func:`kvfuse.kv_cache.mixed_page_layout`. These tests hold
the layout to its contract (every side's bytes inside its page, disjoint, aligned), the reference
write to ``encode_kv`` of each side, the Triton write (interpreted on CPU, compiled with ``-m gpu``)
to the reference byte for byte, and every op to its validation messages. Attention over these
caches is tested in ``test_mixed_attention.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton picks interpreted vs compiled when a kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kvfuse  # noqa: E402
from kvfuse import KVCacheConfig, KVFormat, KVQuantMode, KVScaleGranularity  # noqa: E402
from kvfuse.kv_cache import (MIXED_SIDE_ALIGN, cache_layout, logical_cache_sides, mixed_page_layout,  # noqa: E402
                             read_cache_rows)
from kvfuse.ops import reference as ref  # noqa: E402
from kvfuse.ops import registry  # noqa: E402

from _cache_formats import SENTINEL  # noqa: E402
from test_reference_ops import _opcheck  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
OPS = torch.ops.kvfuse
M = KVQuantMode

# (k_cache_dtype, v_cache_dtype) pairs and the format each gives a bf16 layer.
PAIRS = [
    ("bfloat16", "fp8", KVFormat(M.NONE, M.FP8_E4M3)),
    ("fp8", "nvfp4", KVFormat(M.FP8_E4M3, M.NVFP4)),
    ("nvfp4", "fp8", KVFormat(M.NVFP4, M.FP8_E4M3)),
    ("fp8_per_token_head", "nvfp4", KVFormat(M.FP8_PER_TOKEN_HEAD, M.NVFP4)),
    ("fp8_e5m2", "auto", KVFormat(M.FP8_E5M2, M.NONE)),
    ("nvfp4", "bfloat16", KVFormat(M.NVFP4, M.NONE)),
    ("nvfp4", "fp8_per_token_head", KVFormat(M.NVFP4, M.FP8_PER_TOKEN_HEAD)),
]
PAIR_IDS = [f"{k}-{v}" for k, v, _ in PAIRS]


def _spec(k: str, v: str, heads: int = 3, head_size: int = 64, model_dtype=torch.bfloat16, **config):
    return KVCacheConfig(k_cache_dtype=k, v_cache_dtype=v, **config).layer_spec(
        "model.layers.1.attn", heads, head_size, model_dtype=model_dtype)


def _sentinel_cache(spec, num_blocks: int, block_size: int, device=DEVICE) -> torch.Tensor:
    cache = kvfuse.allocate_kv_cache(spec, num_blocks, block_size, device=device)
    cache.fill_(SENTINEL)
    return cache


# ----------------------------------------------------------------------------- format model


def test_format_codes_round_trip_and_keep_the_uniform_abi():
    for mode in M:
        assert KVFormat(mode, mode).code == int(mode)
        assert KVFormat.from_code(int(mode)) == KVFormat(mode, mode)
    for k in M:
        for v in M:
            if k is v:
                continue
            fmt = KVFormat(k, v)
            assert fmt.code == 0o100 + 8 * int(k) + int(v)
            assert KVFormat.from_code(fmt.code) == fmt and fmt.is_mixed
            assert fmt.name == f"{k.name}/{v.name}"
    for bad in (7, 0o111, 0o100 + 8 * 5, -1, 0o200, "1", 1.0, None):
        with pytest.raises(ValueError, match="is not one of .* nor a mixed format code"):
            KVFormat.from_code(bad)


@pytest.mark.parametrize("k,v,fmt", PAIRS, ids=PAIR_IDS)
def test_per_side_dtypes_give_a_mixed_spec(k, v, fmt):
    spec = _spec(k, v)
    assert spec.kv_format == fmt and spec.is_mixed
    assert spec.kv_quant_mode is fmt.key and spec.v_quant_mode is fmt.value
    assert spec.kv_cache_torch_dtype == torch.uint8
    assert spec.bytes_per_token == 3 * (spec.side_row_bytes(0) + spec.side_row_bytes(1))
    assert spec.cache_shape(5, 16) == (5, 2, 16, 3, spec.page_layout(16).row_dim)
    assert "K: explicit k_cache_dtype" in spec.reason
    with pytest.raises(ValueError, match="row_dim depends on the block size"):
        spec.row_dim


def test_per_side_dtype_precedence_skip_rules_and_checkpoint():
    # kv_cache_dtype sets both sides; a per-side dtype overrides its side only.
    assert _spec(None, "nvfp4", kv_cache_dtype="fp8").kv_format == KVFormat(M.FP8_E4M3, M.NVFP4)
    assert _spec(None, None, kv_cache_dtype="fp8").kv_format == KVFormat(M.FP8_E4M3, M.FP8_E4M3)
    # The same mode on both sides is a uniform layer, whatever the spelling.
    uniform = _spec("fp8_inc", "fp8_e4m3")
    assert not uniform.is_mixed and uniform.kv_cache_torch_dtype == torch.float8_e4m3fn
    # "auto" on one side falls to the checkpoint's dtype, then the model's.
    assert _spec("fp8", "auto", checkpoint_kv_cache_dtype="nvfp4").kv_format == KVFormat(M.FP8_E4M3, M.NVFP4)
    assert _spec("fp8", "auto").kv_format == KVFormat(M.FP8_E4M3, M.NONE)
    # A skip rule keeps both sides in the model dtype.
    config = KVCacheConfig(k_cache_dtype="fp8", v_cache_dtype="nvfp4", skip_layers=("1", "sliding_window"))
    skipped = config.layer_spec("model.layers.1.attn", 3, 64)
    assert skipped.kv_format == KVFormat(M.NONE, M.NONE) and skipped.kv_cache_torch_dtype == torch.bfloat16
    windowed = config.layer_spec("model.layers.2.attn", 3, 64, sliding_window=8)
    assert not windowed.is_mixed and windowed.kv_cache_torch_dtype == torch.bfloat16
    assert config.layer_spec("model.layers.2.attn", 3, 64).is_mixed


def test_per_side_dtype_refusals_name_the_side_and_what_is_allowed():
    with pytest.raises(ValueError, match=r"k_cache_dtype='fp9' is not a KV-cache dtype; valid names are"):
        KVCacheConfig(k_cache_dtype="fp9")
    with pytest.raises(ValueError, match=r"v_cache_dtype=3 is not a KV-cache dtype"):
        KVCacheConfig(v_cache_dtype=3)
    with pytest.raises(ValueError, match="unquantized K side .* stores the model dtype torch.bfloat16, not "
                                         "torch.float32; ask for 'auto' or 'bfloat16'"):
        _spec("float32", "fp8")
    with pytest.raises(ValueError, match="K would be stored as torch.float32 and V as torch.bfloat16"):
        _spec("float32", "bfloat16")
    with pytest.raises(ValueError, match="head_size=72 cannot be stored as NVFP4"):
        _spec("fp8", "nvfp4", head_size=72)


def test_scale_granularity_of_mixed_layers():
    assert _spec("fp8", "nvfp4").scale_granularity is KVScaleGranularity.TENSOR
    per_head = _spec("fp8", "nvfp4", kv_scale_granularity="head")
    assert per_head.scale_granularity is KVScaleGranularity.HEAD and per_head.scale_shape == (3,)
    # A per-token-head side has no static scale; the other side's granularity is the layer's.
    assert _spec("fp8_per_token_head", "nvfp4", kv_scale_granularity="head").scale_shape == (3,)
    assert _spec("fp8_per_token_head", "auto").scale_granularity is KVScaleGranularity.TENSOR


# ----------------------------------------------------------------------------- page layout


@pytest.mark.parametrize("k,v,fmt", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("block_size,heads,head_size,model_dtype", [
    (16, 3, 64, torch.bfloat16), (1, 1, 80, torch.float16), (5, 2, 128, torch.float32), (4, 8, 256, torch.bfloat16)])
def test_mixed_page_sides_are_disjoint_aligned_and_inside_the_page(k, v, fmt, block_size, heads, head_size,
                                                                    model_dtype):
    layout = mixed_page_layout(fmt, block_size, heads, head_size, model_dtype)
    page_bytes = 2 * block_size * heads * layout.row_dim
    k_index, v_index = layout.side_index(0), layout.side_index(1)
    every = torch.cat([k_index.flatten(), v_index.flatten()])
    assert every.unique().numel() == every.numel(), "two logical bytes share a page byte"
    assert int(every.min()) >= 0 and int(every.max()) < page_bytes
    assert int(k_index.max()) < layout.side_offsets[1] <= int(v_index.min())
    assert layout.side_offsets[1] % MIXED_SIDE_ALIGN == 0
    word = max(layout.storage_dtype(s).itemsize for s in (0, 1))
    assert layout.row_dim % word == 0  # the cache views as either side's dtype
    # Padding stays small: less than one alignment unit plus one word per (token, head) pair.
    used = block_size * heads * sum(layout.row_bytes)
    assert page_bytes - used < MIXED_SIDE_ALIGN + 2 * block_size * heads * word
    for side in (0, 1):
        mode = fmt.side(side)
        start = layout.side_index(side)[..., 0]
        if mode is M.FP8_PER_TOKEN_HEAD or mode is M.NONE:
            assert bool((start % layout.storage_dtype(side).itemsize == 0).all())
            if mode is M.FP8_PER_TOKEN_HEAD:
                assert bool(((start + head_size) % 4 == 0).all())  # the float32 scale
        if mode is M.NVFP4:
            assert bool((start % 8 == 0).all())  # whole 8-byte data chunks


def test_an_nvfp4_side_of_a_mixed_page_is_laid_out_like_a_uniform_nvfp4_page_side():
    from kvfuse.kv_cache import nvfp4_page_index, nvfp4_row_dim

    T, H, D = 8, 2, 64
    uniform = nvfp4_page_index(T, H, D)
    side_bytes = T * H * nvfp4_row_dim(D)
    v_side = mixed_page_layout(KVFormat(M.FP8_E4M3, M.NVFP4), T, H, D).side_index(1)
    k_side = mixed_page_layout(KVFormat(M.NVFP4, M.FP8_E4M3), T, H, D).side_index(0)
    offset = mixed_page_layout(KVFormat(M.FP8_E4M3, M.NVFP4), T, H, D).side_offsets[1]
    assert torch.equal(v_side - offset, uniform[1] - side_bytes)  # V scales interleaved, as vLLM's
    assert torch.equal(k_side, uniform[0])


# ----------------------------------------------------------------------------- writes


def _inputs(num_tokens: int, heads: int, head_size: int, dtype=torch.bfloat16, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(num_tokens, heads, head_size, generator=g) * 3).to(dtype)
    v = torch.randn(num_tokens, heads, head_size, generator=g).to(dtype)
    k[0, 0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    v[-1, -1, 3] = float("nan")
    return k.to(device), v.to(device)


def _slots(num_tokens: int, num_blocks: int, block_size: int, device=DEVICE, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[num_tokens // 2] = -1  # a padding token: never written
    return slots.to(device)


def _scales(heads: int, per_head: bool, device=DEVICE):
    if per_head:
        return (torch.tensor([0.02, 0.05, 0.01], device=device)[:heads],
                torch.tensor([0.004, 0.002, 0.003], device=device)[:heads])
    return torch.tensor(0.03, device=device), torch.tensor(0.003, device=device)


@pytest.mark.parametrize("k,v,fmt", PAIRS, ids=PAIR_IDS)
def test_reference_write_stores_each_side_as_its_own_encode_kv(k, v, fmt):
    spec = _spec(k, v)
    cache = _sentinel_cache(spec, 4, 16, device="cpu")
    key, value = _inputs(7, 3, 64, device="cpu")
    slots = _slots(7, 4, 16, device="cpu")
    k_scale, v_scale = _scales(3, per_head=False, device="cpu")
    OPS.encode_and_cache_write(key, value, cache, slots, k_scale, v_scale, fmt.code, spec.layer_name)

    layout = cache_layout(fmt, cache, 64, torch.bfloat16)
    valid = slots >= 0
    blocks, offsets = slots[valid] // 16, slots[valid] % 16
    for side, x, scale in ((0, key, k_scale), (1, value, v_scale)):
        expected = ref.encode_kv(x[valid], scale, fmt.side(side), spec.side_storage_dtype(side))
        got = read_cache_rows(cache, blocks, offsets, side, layout)
        assert got.dtype == expected.dtype
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), f"side {side}"
    # Every byte that belongs to no written row still holds the sentinel.
    written = torch.zeros(cache.shape[0], 2 * 16 * 3 * cache.shape[4], dtype=torch.bool)
    for side in (0, 1):
        index = layout.side_index(side)[offsets]
        written[blocks[:, None, None], index] = True
    assert bool((cache.reshape(cache.shape[0], -1)[~written] == SENTINEL).all())


@pytest.mark.parametrize("k,v,fmt", PAIRS, ids=PAIR_IDS)
def test_unfused_encode_and_cache_write_equals_the_fused_op(k, v, fmt):
    spec = _spec(k, v)
    key, value = _inputs(7, 3, 64, device="cpu")
    slots = _slots(7, 4, 16, device="cpu")
    k_scale, v_scale = _scales(3, per_head=True, device="cpu")
    fused, unfused = _sentinel_cache(spec, 4, 16, "cpu"), _sentinel_cache(spec, 4, 16, "cpu")
    OPS.encode_and_cache_write(key, value, fused, slots, k_scale, v_scale, fmt.code, spec.layer_name)
    k_rows = OPS.encode_kv(key, k_scale, int(fmt.key), spec.side_storage_dtype(0), spec.layer_name)
    v_rows = OPS.encode_kv(value, v_scale, int(fmt.value), spec.side_storage_dtype(1), spec.layer_name)
    OPS.cache_write(k_rows, v_rows, unfused, slots, fmt.code, spec.layer_name)
    assert torch.equal(fused, unfused)


def _fp8_nvfp4_write_case():
    """(spec, (key, value, slots, k_scale, v_scale), cache, cache) of a small FP8-K/NVFP4-V write."""
    spec = _spec("fp8", "nvfp4")
    key, value = _inputs(7, 3, 64)
    inputs = (key, value, _slots(7, 3, 16), *_scales(3, False))
    return spec, inputs, _sentinel_cache(spec, 3, 16), _sentinel_cache(spec, 3, 16)


def _triton_write(*args, **kwargs):
    from kvfuse.ops.triton import kv_write

    return kv_write.encode_and_cache_write(*args, **kwargs)


@pytest.mark.parametrize("k,v,fmt", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("head_size,per_head,dtype", [(64, False, torch.bfloat16), (80, True, torch.float16)],
                         ids=["d64-tensor-bf16", "d80-head-fp16"])
def test_triton_write_is_bit_exact_with_the_reference(k, v, fmt, head_size, per_head, dtype):
    # "auto": the unquantized side stores this test's model dtype.
    spec = _spec(*("auto" if side == "bfloat16" else side for side in (k, v)), head_size=head_size,
                 model_dtype=dtype)
    assert spec.kv_format == fmt
    key, value = _inputs(7, 3, head_size, dtype=dtype)
    slots = _slots(7, 3, 16)
    k_scale, v_scale = _scales(3, per_head)
    expected, got = _sentinel_cache(spec, 3, 16), _sentinel_cache(spec, 3, 16)
    ref.encode_and_cache_write(key, value, expected, slots, k_scale, v_scale, fmt.code)
    _triton_write(key, value, got, slots, k_scale, v_scale, fmt.code)
    mismatch = (expected != got).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.shape[0]} bytes differ, first at {mismatch[:4].tolist()}"


def test_triton_write_fails_when_the_v_side_lands_elsewhere(monkeypatch):
    """The bit-exact test can fail: a layout whose V side starts 16 bytes late is caught."""
    import dataclasses

    from kvfuse.ops.triton import kv_write

    spec, (key, value, slots, k_scale, v_scale), expected, got = _fp8_nvfp4_write_case()
    ref.encode_and_cache_write(key, value, expected, slots, k_scale, v_scale, spec.kv_format.code)
    real = kv_write.mixed_page_layout

    def shifted(*args, **kwargs):
        layout = real(*args, **kwargs)
        return dataclasses.replace(layout, side_offsets=(0, layout.side_offsets[1] + 16))

    monkeypatch.setattr(kv_write, "mixed_page_layout", shifted)
    kv_write.encode_and_cache_write(key, value, got, slots, k_scale, v_scale, spec.kv_format.code)
    assert not torch.equal(expected, got)


@pytest.mark.gpu
@pytest.mark.parametrize("k,v,fmt", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("num_tokens,head_size", [(533, 128), (4099, 64), (7, 256), (64, 80)])
def test_gpu_write_is_bit_exact_with_the_reference(k, v, fmt, num_tokens, head_size):
    spec = KVCacheConfig(k_cache_dtype=k, v_cache_dtype=v).layer_spec("model.layers.1.attn", 8, head_size)
    key, value = _inputs(num_tokens, 8, head_size, device="cuda", seed=num_tokens)
    num_blocks = num_tokens // 16 + 2
    slots = _slots(num_tokens, num_blocks, 16, device="cuda")
    k_scale, v_scale = torch.tensor(0.03, device="cuda"), torch.tensor(0.003, device="cuda")
    expected, got = _sentinel_cache(spec, num_blocks, 16, "cuda"), _sentinel_cache(spec, num_blocks, 16, "cuda")
    ref.encode_and_cache_write(key, value, expected, slots, k_scale, v_scale, fmt.code)
    OPS.encode_and_cache_write(key, value, got, slots, k_scale, v_scale, fmt.code, spec.layer_name)
    assert registry.select("encode_and_cache_write", "cuda", fmt.code, num_tokens).name == "triton"
    assert torch.equal(expected, got)


# ----------------------------------------------------------------------------- the op contract


def _attention_args(spec, cache, q_dtype=torch.bfloat16, heads=6, head_size=64):
    query = torch.randn(2, heads, head_size).to(q_dtype)
    return (query, cache, torch.tensor(0.03), torch.tensor(0.003), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
            torch.tensor([20, 9], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32),
            spec.kv_format.code, 0.125, None, spec.layer_name)


def test_ops_refuse_mixed_caches_that_do_not_fit_and_name_what_is_expected():
    spec = _spec("fp8", "nvfp4")
    cache = kvfuse.allocate_kv_cache(spec, 4, 16)
    key, value = _inputs(7, 3, 64, device="cpu")
    slots = _slots(7, 4, 16, device="cpu")
    one = torch.tensor(1.0)
    code = spec.kv_format.code
    with pytest.raises(ValueError, match=r"a FP8_E4M3/NVFP4 \(K/V\) cache is uint8 pages"):
        OPS.encode_and_cache_write(key, value, cache.view(torch.float8_e4m3fn), slots, one, one, code, "l")
    with pytest.raises(ValueError, match=r"row_dim=48 does not fit a FP8_E4M3/NVFP4 \(K/V\) page .* \(expected 50\)"):
        OPS.encode_and_cache_write(key, value, cache[..., :48], slots, one, one, code, "l")
    with pytest.raises(ValueError, match=r"the V side \(NVFP4\): head_size=72 cannot be stored as NVFP4"):
        OPS.paged_attention(*_attention_args(spec, cache, head_size=72))
    strided = torch.zeros(4, 2, 16, 3, 60, dtype=torch.uint8)[..., :50]
    with pytest.raises(ValueError, match="not contiguous within a page"):
        OPS.encode_and_cache_write(key, value, strided, slots, one, one, code, "l")
    with pytest.raises(ValueError, match=r"kv_quant_mode=73 is not one of"):  # 0o111: both sides FP8_E4M3
        OPS.encode_and_cache_write(key, value, cache, slots, one, one, 0o111, "l")
    with pytest.raises(ValueError, match=r"kv_quant_mode=75 is not one of"):  # encode_kv encodes one side
        OPS.encode_kv(key, one, code, torch.uint8, "l")
    # cache_write: each side's rows in its own mode's dtype and width.
    k_rows = OPS.encode_kv(key, one, int(M.FP8_E4M3), torch.float8_e4m3fn, "l")
    v_rows = OPS.encode_kv(value, one, int(M.NVFP4), torch.uint8, "l")
    with pytest.raises(ValueError, match=r"value_rows.dtype=torch.float8_e4m3fn is not what NVFP4 rows are"):
        OPS.cache_write(k_rows, k_rows, cache, slots, code, "l")
    with pytest.raises(ValueError, match=r"key_rows \(FP8_E4M3, 64 wide\) hold head_size 64 but value_rows "
                                         r"\(NVFP4, 72 wide\) hold 128"):
        OPS.cache_write(k_rows, OPS.encode_kv(torch.randn(7, 3, 128), one, int(M.NVFP4), torch.uint8, "l"),
                        cache, slots, code, "l")
    OPS.cache_write(k_rows, v_rows, cache, slots, code, "l")  # the right rows pass


def test_attention_over_a_mixed_cache_with_an_unquantized_side_takes_the_query_dtype():
    spec = _spec("auto", "fp8")
    cache = kvfuse.allocate_kv_cache(spec, 4, 16)
    with pytest.raises(ValueError, match=r"row_dim=96 does not fit .* unquantized side of query's dtype "
                                         r"torch.float32 \(expected 160\)"):
        OPS.paged_attention(*_attention_args(spec, cache, q_dtype=torch.float32))
    out = OPS.paged_attention(*_attention_args(spec, cache))
    assert out.shape == (2, 6, 64) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("k,v,fmt", PAIRS[:4], ids=PAIR_IDS[:4])
def test_opcheck_every_op_with_a_mixed_format(k, v, fmt):
    spec = _spec(k, v)
    key, value = torch.randn(7, 3, 64).bfloat16(), torch.randn(7, 3, 64).bfloat16()
    slots = _slots(7, 4, 16, device="cpu")
    k_scale, v_scale = _scales(3, per_head=False, device="cpu")
    cache = kvfuse.allocate_kv_cache(spec, 4, 16)
    # With an FP8 side the reference computes on float8 tensors, which opcheck's schema test cannot
    # compare on CPU: _opcheck then checks the mutations by hand.
    fp8 = torch.float8_e4m3fn if any(m.is_fp8 for m in fmt.sides) else torch.uint8
    _opcheck(OPS.encode_and_cache_write.default,
             (key, value, cache, slots, k_scale, v_scale, fmt.code, spec.layer_name), fp8)
    k_rows = OPS.encode_kv(key, k_scale, int(fmt.key), spec.side_storage_dtype(0), spec.layer_name)
    v_rows = OPS.encode_kv(value, v_scale, int(fmt.value), spec.side_storage_dtype(1), spec.layer_name)
    _opcheck(OPS.cache_write.default, (k_rows, v_rows, cache, slots, fmt.code, spec.layer_name), fp8)
    cos, sin = torch.randn(7, 64), torch.randn(7, 64)
    _opcheck(OPS.rope_encode_and_cache_write.default,
             (None, key, value, cache, slots, k_scale, v_scale, cos, sin, None, 64, True, fmt.code, spec.layer_name),
             fp8)
    _opcheck(OPS.paged_attention.default, _attention_args(spec, cache), fp8)


def test_registry_runs_mixed_formats_only_where_declared():
    fmt = KVFormat(M.FP8_E4M3, M.NVFP4)
    assert registry.unavailable_reason("native", "encode_and_cache_write", "cpu", fmt.code) == \
        "native does not support FP8_E4M3/NVFP4 (K/V) caches for encode_and_cache_write"
    assert registry.unavailable_reason("reference", "paged_attention", "cpu", fmt.code) is None
    assert registry.select("encode_and_cache_write", "cpu", fmt.code, 7).name == "reference"


# ----------------------------------------------------------------------------- calibration


def test_calibration_sets_each_side_by_its_own_format():
    layer = kvfuse.PagedAttention(6, 3, 64, "model.layers.1.attn",
                                  config=KVCacheConfig(k_cache_dtype="fp8", v_cache_dtype="nvfp4"))
    pth = kvfuse.PagedAttention(6, 3, 64, "model.layers.2.attn",
                                config=KVCacheConfig(k_cache_dtype="fp8_per_token_head", v_cache_dtype="fp8"))
    model = torch.nn.ModuleList([layer, pth])
    key, value = _inputs(7, 3, 64, device="cpu")
    key, value = torch.nan_to_num(key, posinf=0.0, neginf=0.0), torch.nan_to_num(value)
    query = torch.randn(7, 6, 64).bfloat16()
    caches = [kvfuse.allocate_kv_cache(attn.spec, 1, 16) for attn in model]
    metadata = kvfuse.AttentionMetadata(torch.arange(7), torch.zeros(1, 1, dtype=torch.int32),
                                        torch.tensor([7], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32))

    def forward(batch):
        for attn, cache in zip(model, caches):
            attn(query, key, value, cache, metadata)

    result = kvfuse.calibrate_scales(model, [0], forward=forward)
    k_amax, v_amax = float(key.float().abs().max()), float(value.float().abs().max())
    assert float(layer.k_scale) == pytest.approx(k_amax / 448.0)
    assert float(layer.v_scale) == pytest.approx(v_amax / (448.0 * 6.0))
    assert float(pth.k_scale) == 1.0  # per-token-head: the rows carry their scales
    assert float(pth.v_scale) == pytest.approx(v_amax / 448.0)
    assert result["model.layers.1.attn"].v_quant_mode is M.NVFP4


def test_rotary_pass_leaves_mixed_layers_unfused_where_only_the_reference_would_rotate():
    from types import SimpleNamespace

    from kvfuse.passes.fuse_rope_cache_write import _kernel_problem

    mixed = KVFormat(M.FP8_E4M3, M.NVFP4)
    site = SimpleNamespace(args={"kv_quant_mode": mixed.code}, kv_quant_mode=mixed)
    assert "no GPU kernel rotates into FP8_E4M3/NVFP4 caches" in _kernel_problem(site, "cuda")
    assert _kernel_problem(site, "cpu") is None  # on CPU the reference is every format's kernel
    uniform = SimpleNamespace(args={"kv_quant_mode": int(M.NVFP4)}, kv_quant_mode=M.NVFP4)
    assert _kernel_problem(uniform, "cuda") is None


def test_the_op_hands_the_triton_write_a_code_it_reads():
    """The op passes a KVFormat to the registry's kernel; every kernel reads it as ``int(...)``."""
    from kvfuse.ops.triton import kv_write

    spec, (key, value, slots, k_scale, v_scale), by_code, by_format = _fp8_nvfp4_write_case()
    kv_write.encode_and_cache_write(key, value, by_code, slots, k_scale, v_scale, spec.kv_format.code)
    kv_write.encode_and_cache_write(key, value, by_format, slots, k_scale, v_scale, spec.kv_format)
    assert int(spec.kv_format) == 0o113 and torch.equal(by_code, by_format)
