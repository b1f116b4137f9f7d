"""The NVFP4 cache page is vLLM's: a cache kvfuse writes reads correctly through vLLM's views,
and a page laid out by vLLM's writer is what kvfuse writes and reads.

The "vLLM side" here is written from vLLM's own definitions, not from kvfuse's index map
(`kvfuse.kv_cache.nvfp4_page_index`): `nvfp4_kv_cache_split_views` / `_nvfp4_split_data_scale`
(vllm/utils/torch_utils.py: per page side, data then scales, strides scaled by the row width
ratio), the writer's V-scale interleave `swizzle_scale_offset` and the test inverse
`dequant_nvfp4_kv_cache` (`reshape(T//4, 4, S//4, 4)` of each head's scale plane). vLLM main as
of v0.25.1 (752a3a504485790a2e8491cacbb35c137339ad34): K scales linear, V scales interleaved.
"""

from __future__ import annotations

import pytest
import torch

import kvfuse
from kvfuse.kv_cache import E2M1_VALUES, KVQuantMode, logical_cache_rows, nvfp4_v_scales_swizzled
from kvfuse.ops import reference, registry
from tests.ops._cache_formats import SENTINEL, sentinel_cache

NVFP4 = int(KVQuantMode.NVFP4)


# ----------------------------------------------------------------------------- vLLM's side


def vllm_split_side(kv_side: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-side split: ``kv_side (pages, T, H, full_dim)`` -> data ``(pages, T, H, D/2)``
    and scale ``(pages, T, H, D/16)`` views; the scale region follows all of the side's data."""
    pages, dim_1, dim_2, full_dim = kv_side.shape
    data_dim = full_dim * 8 // 9
    scale_dim = full_dim - data_dim
    page_stride = kv_side.stride(0)
    base = kv_side.storage_offset()
    data = torch.as_strided(kv_side, (pages, dim_1, dim_2, data_dim),
                            (page_stride, kv_side.stride(1) * data_dim // full_dim,
                             kv_side.stride(2) * data_dim // full_dim, 1), base)
    scale = torch.as_strided(kv_side, (pages, dim_1, dim_2, scale_dim),
                             (page_stride, kv_side.stride(1) * scale_dim // full_dim,
                              kv_side.stride(2) * scale_dim // full_dim, 1), base + dim_1 * dim_2 * data_dim)
    return data, scale


def vllm_deswizzle(planes: torch.Tensor) -> torch.Tensor:
    """``(..., T, S)`` scale planes as the writer stores V scales -> logical ``[t, j]`` order."""
    *batch, T, S = planes.shape
    grouped = planes.reshape(*batch, T // 4, 4, S // 4, 4)  # [token group, j // (S/4), j % (S/4), t % 4]
    n = grouped.dim()
    return grouped.permute(*range(n - 4), n - 4, n - 1, n - 3, n - 2).reshape(*batch, T, S)


def vllm_swizzle(planes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`vllm_deswizzle`: logical ``(..., T, S)`` -> the writer's V-scale planes."""
    *batch, T, S = planes.shape
    grouped = planes.reshape(*batch, T // 4, 4, 4, S // 4)  # [token group, t % 4, j // (S/4), j % (S/4)]
    n = grouped.dim()
    return grouped.permute(*range(n - 4), n - 4, n - 2, n - 1, n - 3).reshape(*batch, T, S)


def vllm_read(kv_cache: torch.Tensor, side: int, swizzled_v: bool):
    """(data ``[pages, T, H, D/2]`` uint8, block scales ``[pages, T, H, S]`` float) of one side."""
    data, scale = vllm_split_side(kv_cache[:, side])
    scale = scale.view(torch.float8_e4m3fn).float()
    if side == 1 and swizzled_v:
        planes = scale.permute(0, 2, 1, 3)  # [pages, H, T, S]: each head's (T, S) plane
        scale = vllm_deswizzle(planes.contiguous()).permute(0, 2, 1, 3)
    return data, scale


def vllm_write(kv_cache: torch.Tensor, side: int, swizzled_v: bool, data: torch.Tensor, scale_bytes: torch.Tensor):
    """Place logical data ``[pages, T, H, D/2]`` and scale bytes ``[pages, T, H, S]`` as vLLM's writer does."""
    data_view, scale_view = vllm_split_side(kv_cache[:, side])
    data_view.copy_(data)
    if side == 1 and swizzled_v:
        scale_bytes = vllm_swizzle(scale_bytes.permute(0, 2, 1, 3).contiguous()).permute(0, 2, 1, 3)
    scale_view.copy_(scale_bytes)


def decode(data: torch.Tensor, scales: torch.Tensor, global_scale: float) -> torch.Tensor:
    """e2m1 (even element in the low nibble) x block scale x global scale -> ``[..., D]``."""
    lut = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES])
    values = torch.stack([lut[(data & 0xF).long()], lut[(data >> 4).long()]], dim=-1).flatten(-2)
    return (values.unflatten(-1, (-1, 16)) * scales.unsqueeze(-1) * global_scale).flatten(-2)


# ----------------------------------------------------------------------------- tests

WRITE_BACKENDS = ["reference", "triton", "native"]


@pytest.fixture(params=WRITE_BACKENDS)
def write_backend(request, monkeypatch):
    """Every cache-write implementation this machine has writes the same page."""
    name = request.param
    monkeypatch.setenv("KVFUSE_CACHE_WRITE_BACKEND", name)
    registry.clear_cache()
    reason = registry.unavailable_reason(name, "encode_and_cache_write", "cpu", KVQuantMode.NVFP4)
    if reason:
        pytest.skip(reason)
    yield name
    monkeypatch.delenv("KVFUSE_CACHE_WRITE_BACKEND")
    registry.clear_cache()


SHAPES = [  # (block_size, num_kv_heads, head_size)
    (16, 2, 128),  # interleaved V scales (S = 8)
    (16, 3, 64),  # S = 4: one block per column group
    (8, 1, 256),
    (4, 2, 64),  # one token group per page
    (16, 2, 80),  # S = 5: vLLM's interleave is not a permutation; kvfuse keeps V linear
    (6, 2, 128),  # block_size % 4 != 0: linear V
]


def _kv(num_tokens, heads, head_size, seed):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_tokens, heads, head_size, generator=gen) * 3
    v = torch.randn(num_tokens, heads, head_size, generator=gen) * 3
    k[:, :, 5] *= 40  # an outlier channel: block scales vary within a row
    return k.bfloat16(), v.bfloat16()


@pytest.mark.parametrize("block_size,heads,head_size", SHAPES, ids=lambda v: str(v))
def test_kvfuse_pages_read_through_vllm_views(block_size, heads, head_size, write_backend):
    num_blocks = 5
    num_tokens = num_blocks * block_size - 3
    key, value = _kv(num_tokens, heads, head_size, seed=block_size * head_size)
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    k_scale, v_scale = torch.tensor(0.25), torch.tensor(0.5)
    cache = sentinel_cache((num_blocks, 2, block_size, heads, head_size // 2 + head_size // 16), torch.uint8)

    kvfuse.ops.encode_and_cache_write(key, value, cache, slots, k_scale, v_scale, NVFP4, "model.layers.0.attn")

    swizzled = nvfp4_v_scales_swizzled(block_size, head_size)
    assert swizzled == (block_size % 4 == 0 and head_size // 16 % 4 == 0)
    for side, x, gs in ((0, key, k_scale), (1, value, v_scale)):
        data, scales = vllm_read(cache, side, swizzled)
        got = decode(data, scales, float(gs))[slots // block_size, slots % block_size]
        expected = reference.decode_rows(reference.encode_kv(x, gs, NVFP4, torch.uint8), gs, NVFP4)
        assert torch.equal(got, expected), f"side {side}"
    # The three unwritten slots per side kept every byte, wherever the layout put them.
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots] = True
    rows = logical_cache_rows(cache).transpose(1, 2).flatten(0, 1)  # [slot, side, H, F]
    assert (rows[~written] == SENTINEL).all() and (rows[written] != SENTINEL).any()


@pytest.mark.parametrize("block_size,heads,head_size", SHAPES, ids=lambda v: str(v))
def test_vllm_laid_pages_equal_kvfuse_pages(block_size, heads, head_size, write_backend):
    """Every slot written: vLLM's placement of the encoded rows is byte for byte kvfuse's page."""
    num_blocks = 3
    num_tokens = num_blocks * block_size
    key, value = _kv(num_tokens, heads, head_size, seed=7)
    k_scale, v_scale = torch.tensor(0.125), torch.tensor(2.0)
    shape = (num_blocks, 2, block_size, heads, head_size // 2 + head_size // 16)
    ours = sentinel_cache(shape, torch.uint8)
    kvfuse.ops.encode_and_cache_write(key, value, ours, torch.arange(num_tokens), k_scale, v_scale, NVFP4, "m.layers.0.a")

    theirs = torch.zeros(shape, dtype=torch.uint8)
    swizzled = nvfp4_v_scales_swizzled(block_size, head_size)
    for side, x, gs in ((0, key, k_scale), (1, value, v_scale)):
        rows = reference.encode_kv(x, gs, NVFP4, torch.uint8).reshape(num_blocks, block_size, heads, -1)
        vllm_write(theirs, side, swizzled, rows[..., : head_size // 2], rows[..., head_size // 2:])
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("block_size,heads,head_size", [(16, 2, 128), (4, 1, 64), (5, 2, 80)], ids=str)
def test_attention_reads_a_vllm_written_page(block_size, heads, head_size):
    """A cache laid out by vLLM's writer: kvfuse's reference and Triton attention read the same
    values as dense attention over the decoded K/V."""
    from kvfuse.ops.registry import AttentionCall
    from kvfuse.ops.triton.attention import paged_attention

    num_blocks, seq_len, num_q_heads = 4, 3 * block_size + 1, 2 * heads
    key, value = _kv(seq_len, heads, head_size, seed=3)
    gs = (torch.tensor(0.25), torch.tensor(0.5))
    swizzled = nvfp4_v_scales_swizzled(block_size, head_size)
    cache = torch.zeros((num_blocks, 2, block_size, heads, head_size // 2 + head_size // 16), dtype=torch.uint8)
    pad = num_blocks * block_size - seq_len
    page_order = torch.tensor([2, 0, 3, 1])
    dense = []
    for side, x in ((0, key), (1, value)):
        rows = reference.encode_kv(x, gs[side], NVFP4, torch.uint8)
        dense.append(reference.decode_rows(rows, gs[side], NVFP4))
        rows = torch.cat([rows, torch.zeros(pad, heads, rows.shape[-1], dtype=torch.uint8)])
        rows = rows.reshape(num_blocks, block_size, heads, -1)[page_order.argsort()]  # logical block b -> page
        vllm_write(cache, side, swizzled, rows[..., : head_size // 2], rows[..., head_size // 2:])
    query = torch.randn(2, num_q_heads, head_size, generator=torch.Generator().manual_seed(5))
    call = AttentionCall(query, cache, gs[0], gs[1], page_order[None].to(torch.int32),
                         torch.tensor([seq_len], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32),
                         NVFP4, head_size ** -0.5, None)
    k, v = (d.repeat_interleave(num_q_heads // heads, dim=1) for d in dense)
    pos = torch.arange(seq_len)
    allowed = pos[None, :] <= (seq_len - 2 + torch.arange(2))[:, None]
    scores = torch.einsum("qhd,khd->hqk", query, k) * head_size ** -0.5
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
    torch.testing.assert_close(reference.paged_attention(call), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(paged_attention(call), expected, atol=2e-4, rtol=2e-4)


def test_page_index_is_a_bijection_and_matches_the_formulas():
    from kvfuse.kv_cache import nvfp4_page_index

    T, H, D = 8, 3, 128
    S, half = D // 16, D // 2
    index = nvfp4_page_index(T, H, D)
    assert sorted(index.flatten().tolist()) == list(range(2 * T * H * (half + S)))
    side = T * H * (half + S)
    # V scale of token 6, head 1, block 5: group of tokens 4..7, column group 5 // 2 = 2, 5 % 2 = 1.
    assert index[1, 6, 1, half + 5] == side + T * H * half + ((4 + 2) * H + 1) * S + 4 * 1 + 6 % 4
    assert index[0, 6, 1, half + 5] == T * H * half + (6 * H + 1) * S + 5
    assert index[1, 6, 1, 3] == side + (6 * H + 1) * half + 3


def test_nvfp4_cache_must_be_contiguous_within_a_page():
    spec = kvfuse.KVCacheConfig(kv_cache_dtype="nvfp4").layer_spec("model.layers.0.attn", 2, 64)
    pages_apart = torch.zeros(4, 3, 2, 16, 2, 36, dtype=torch.uint8)[:, 1]  # pages apart: fine
    assert pages_apart.shape == spec.cache_shape(4, 16)
    key = torch.randn(3, 2, 64, dtype=torch.bfloat16)
    one = torch.tensor(1.0)
    kvfuse.ops.encode_and_cache_write(key, key, pages_apart, torch.arange(3), one, one, NVFP4, "model.layers.0.attn")
    heads_major = torch.zeros(4, 2, 2, 16, 36, dtype=torch.uint8).transpose(2, 3)  # HND inside a page
    with pytest.raises(ValueError, match=r"NVFP4 kv_cache \(4, 2, 16, 2, 36\).*not contiguous within a page"):
        kvfuse.ops.encode_and_cache_write(key, key, heads_major, torch.arange(3), one, one, NVFP4,
                                          "model.layers.0.attn")
