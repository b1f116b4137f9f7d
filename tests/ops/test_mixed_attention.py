"""Triton paged attention over mixed-format caches (K and V sides in different modes) vs the reference.

Caches are written by the reference ``encode_and_cache_write`` into pages allocated from the
layer's own spec (``KVCacheConfig(k_cache_dtype=..., v_cache_dtype=...)``) and first filled with
0xFF, which is NaN in every side format (a bf16 / fp16 / fp32 value, an e4m3 or e5m2 byte, a
per-token-head float32 scale, an NVFP4 block scale): a read of an unused page, of a slot past a
sequence's end, or of the wrong side's bytes turns the output into NaN or garbage. Block-table
entries past each sequence's pages point far out of the cache.
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    # Must be set before the kernels are decorated; CPU-only hosts can only interpret them.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import kvfuse  # noqa: E402
from kvfuse.kv_cache import KVCacheConfig, KVFormat, KVQuantMode, cache_layout, read_cache_rows  # noqa: E402
from kvfuse.ops import reference  # noqa: E402
from kvfuse.ops import registry  # noqa: E402
from kvfuse.ops.registry import AttentionCall  # noqa: E402

from test_triton_attention import DEVICE, ON_GPU, gpu, scattered_block_table  # noqa: E402

triton = pytest.importorskip("triton")

#: (k_cache_dtype, v_cache_dtype) by test id; "auto" keeps a side in the model dtype.
PAIRS = {
    "bf16-fp8": ("auto", "fp8"),
    "fp8-nvfp4": ("fp8", "nvfp4"),
    "nvfp4-fp8": ("nvfp4", "fp8"),
    "pth-nvfp4": ("fp8_per_token_head", "nvfp4"),
    "e5m2-bf16": ("fp8_e5m2", "auto"),
    "nvfp4-bf16": ("nvfp4", "auto"),
}

# Unit roundoff (half an ulp, relative) of each dtype.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


def make_case(pair, seq_lens, q_lens, num_q_heads, num_kv_heads, head_size, *, page=8, q_dtype=torch.bfloat16,
              per_head_scales=False, pad_rows=2, seed=0, device=DEVICE):
    """A scattered, 0xFF-poisoned mixed-format cache holding exactly ``seq_lens`` tokens per sequence;
    returns the call's arguments (``kv_quant_mode``: the layer's :class:`KVFormat`)."""
    gen = torch.Generator().manual_seed(seed)
    k_dtype, v_dtype = PAIRS[pair]
    cfg = KVCacheConfig(k_cache_dtype=k_dtype, v_cache_dtype=v_dtype,
                        kv_scale_granularity="head" if per_head_scales else "tensor")
    spec = cfg.layer_spec("model.layers.0.self_attn.attn", num_kv_heads, head_size, q_dtype)
    fmt = spec.kv_format
    assert fmt.is_mixed, fmt
    num_blocks, block_table = scattered_block_table(seq_lens, page, 3, gen)
    cache = kvfuse.allocate_kv_cache(spec, num_blocks, page)
    cache.fill_(0xFF)
    # NVFP4 global scales around 1/8 keep the e4m3 block scales of N(0, 4) data in their normal range.
    scales = []
    for mode, base in ((fmt.key, 0.7), (fmt.value, 1.3)):
        if per_head_scales:
            value = base * torch.linspace(0.6, 1.4, num_kv_heads)
        else:
            value = torch.tensor(base)
        scales.append((value / 8 if mode is KVQuantMode.NVFP4 else value).to(torch.float32).reshape(spec.scale_shape))
    k_scale, v_scale = scales
    for b, s in enumerate(seq_lens):
        pos = torch.arange(s)
        slots = block_table[b, pos // page].long() * page + pos % page
        k = torch.randn(s, num_kv_heads, head_size, generator=gen) * 2
        v = torch.randn(s, num_kv_heads, head_size, generator=gen) * 2
        reference.encode_and_cache_write(k.to(q_dtype), v.to(q_dtype), cache, slots, k_scale, v_scale, fmt.code)
    query = torch.randn(sum(q_lens) + pad_rows, num_q_heads, head_size, generator=gen).to(q_dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    args = dict(query=query, kv_cache=cache, k_scale=k_scale, v_scale=v_scale, block_table=block_table,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=qsl, kv_quant_mode=fmt,
                sm_scale=1.0 / math.sqrt(head_size), sliding_window=None)
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def _decoded_sides(args):
    """Every cached K and V row, decoded as the reference decodes them: float32 ``[rows, Hkv, D]`` each."""
    fmt, cache = args["kv_quant_mode"], args["kv_cache"]
    layout = cache_layout(fmt, cache, args["query"].shape[2], args["query"].dtype)
    page = cache.shape[2]
    blocks, offsets = [], []
    for b, s in enumerate(args["seq_lens"].tolist()):
        pos = torch.arange(s, device=cache.device)
        blocks.append(args["block_table"][b, pos // page].long())
        offsets.append(pos % page)
    blocks, offsets = torch.cat(blocks), torch.cat(offsets)
    return tuple(reference.decode_rows(read_cache_rows(cache, blocks, offsets, side, layout), scale, mode)
                 for side, (mode, scale) in enumerate(((fmt.key, args["k_scale"]), (fmt.value, args["v_scale"]))))


def dot_dtype(fmt: KVFormat, q_dtype: torch.dtype) -> torch.dtype:
    """The dtype the launcher's dots run in (see ``attention.paged_attention``): float32 under the
    interpreter; on a GPU fp16 for a bf16 query when both sides are quantized, else the query's."""
    if not ON_GPU:
        return torch.float32
    if q_dtype == torch.bfloat16 and KVQuantMode.NONE not in fmt.sides:
        return torch.float16
    return q_dtype


def tolerances(args, max_keys: int) -> tuple[float, float]:
    """(atol, rtol) of the Triton output against the reference's for ``args``, from the rounding each
    step adds. Kernel and reference decode every side identically (each side's values, fp8, e4m3 x
    row scale, e2m1 x block scale x 2^-6, bf16, are exact in the dot dtype), so only roundings differ:

    - P, rounded to the dot dtype (unit roundoff ``u_dot``) before ``P @ V``, per-token-head V scales
      included: ``|dO| <= u_dot * sum_j p_j |v_j| <= u_dot * max|v|`` (the weights sum to <= 1);
    - scores in float32 (the query exact in the dot dtype): ``|ds| <= (D + 2) * 2^-24 * |q| |k| *
      sm_scale`` (Cauchy-Schwarz over the D-term dot; soft-capping only shrinks it), moving every
      softmax weight by a factor within ``exp(+-2 ds)``: ``|dO| <= 2 * ds * max|v|``;
    - float32 accumulation of up to ``max_keys`` products and the split reduction, and exp2:
      ``(max_keys + 8) * 2^-24 * max|v|``;
    - both outputs rounded to the query dtype: one ulp apart, ``rtol = 2 * u_out``.
    """
    query, fmt = args["query"], args["kv_quant_mode"]
    k, v = _decoded_sides(args)
    u32 = 2.0 ** -24
    v_max = float(v.abs().max())
    q_norm = float(query.float().norm(dim=-1).max())
    k_norm = float(k.norm(dim=-1).max())
    score_error = (query.shape[2] + 2) * u32 * q_norm * k_norm * args["sm_scale"]
    atol = (UNIT_ROUNDOFF[dot_dtype(fmt, query.dtype)] + 2 * score_error + (max_keys + 8) * u32) * v_max
    return atol, 2 * UNIT_ROUNDOFF[query.dtype]


def poison_allocator(nbytes: int) -> None:
    """Leave NaN in the CUDA caching allocator's free blocks, so outputs the kernel never writes show."""
    if ON_GPU:
        # Capped: tests share the GPU (pytest -n 8), and the launcher's buffers are far smaller.
        junk = torch.full((min(nbytes, 1 << 30) // 4 + 1024,), float("nan"), device="cuda")
        del junk


def check(args, window=None, **options):
    """Triton vs the reference (run on the same device); ``options`` go to the launcher."""
    from kvfuse.ops.triton.attention import paged_attention

    args = dict(args, sliding_window=window)
    expected = reference.paged_attention(AttentionCall(**args))
    poison_allocator(16 * args["query"].numel() * 4 * 32)
    out = paged_attention(AttentionCall(**args), **options)
    assert out.shape == args["query"].shape and out.dtype == args["query"].dtype
    covered = int(args["query_start_loc"][-1])
    atol, rtol = tolerances(args, int(args["seq_lens"].max()))
    torch.testing.assert_close(out[:covered].float(), expected[:covered].float(), atol=atol, rtol=rtol)
    assert torch.all(out[covered:] == 0), "padding rows must be zeros"
    return out


# ----------------------------------------------------------------------------- CPU (interpreter) + GPU


@pytest.mark.parametrize("head_size", [64, 80])
@pytest.mark.parametrize("pair", PAIRS)
def test_decode(pair, head_size):
    # GQA (2 query heads per KV head); a one-token sequence, one ending mid-page, one of exactly 5 pages.
    check(make_case(pair, [1, 17, 40], [1, 1, 1], 4, 2, head_size, seed=1))


@pytest.mark.parametrize("pair,head_size", [("bf16-fp8", 128), ("fp8-nvfp4", 128), ("nvfp4-fp8", 64),
                                            ("pth-nvfp4", 80), ("e5m2-bf16", 80), ("nvfp4-bf16", 128)])
def test_prefill_and_mixed_batch(pair, head_size):
    # A fresh 7-token prefill, a 33-token chunk over a 10-token prefix, one decode token.
    check(make_case(pair, [7, 43, 20], [7, 33, 1], 2, 1, head_size, seed=2))


def attention_float64(args, window=None) -> torch.Tensor:
    """Causal attention in float64 over every side decoded exactly (:func:`_decoded_sides`): the
    value the kernel approximates, independent of the reference's float32 arithmetic."""
    k_all, v_all = (t.double() for t in _decoded_sides(args))
    query = args["query"].double()
    out = torch.zeros_like(query)
    qsl, lens = args["query_start_loc"].tolist(), args["seq_lens"].tolist()
    group = query.shape[1] // k_all.shape[1]
    first = 0
    for b, seq_len in enumerate(lens):
        k, v = (t[first:first + seq_len].repeat_interleave(group, dim=1) for t in (k_all, v_all))
        first += seq_len
        q = query[qsl[b]:qsl[b + 1]]
        scores = torch.einsum("qhd,khd->hqk", q, k) * args["sm_scale"]
        qpos = torch.arange(seq_len - q.shape[0], seq_len, device=q.device)[:, None]
        kpos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = (kpos <= qpos) & ((qpos - kpos) < window if window else True)
        out[qsl[b]:qsl[b + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~allowed, -torch.inf),
                                                                             -1), v)
    return out


@pytest.mark.parametrize("pair", PAIRS)
def test_against_float64(pair):
    """Every K/V format pair against float64 attention over the exactly decoded sides, within the
    bound :func:`tolerances` states (P's rounding to the dot dtype, float32 scores and sums, the
    output's rounding); a decode row, a fresh prefill and a chunk over a cached prefix, GQA."""
    from kvfuse.ops.triton.attention import paged_attention

    args = dict(make_case(pair, [7, 43, 20], [7, 33, 1], 4, 2, 64, seed=9), sliding_window=None)
    exact = attention_float64(args)
    atol, rtol = tolerances(args, int(args["seq_lens"].max()))
    covered = int(args["query_start_loc"][-1])
    out = paged_attention(AttentionCall(**args))
    torch.testing.assert_close(out[:covered].double(), exact[:covered], atol=atol, rtol=rtol)
    # The bound is tight enough to tell the formats apart: the other side's decoding is far outside it.
    swapped = dict(args, k_scale=args["v_scale"], v_scale=args["k_scale"])
    if not torch.equal(args["k_scale"], args["v_scale"]):
        assert not torch.allclose(attention_float64(swapped)[:covered], exact[:covered], atol=atol, rtol=rtol)


def test_sliding_window():
    check(make_case("fp8-nvfp4", [7, 43, 20], [7, 33, 1], 4, 2, 64, seed=3), window=9)


def test_soft_cap():
    args = make_case("nvfp4-fp8", [7, 43], [7, 33], 2, 1, 64, seed=4)
    args["sm_scale"] = 0.5  # scores of +-10 and more: a cap of 5 bends them
    check(dict(args, logit_softcap=5.0))


def test_sinks():
    args = make_case("pth-nvfp4", [7, 43, 20], [7, 33, 1], 4, 2, 64, seed=5)
    sinks = torch.tensor([-1.0, 0.5, 2.0, float("-inf")], device=DEVICE)
    check(dict(args, sinks=sinks))


@pytest.mark.parametrize("pair", ["fp8-nvfp4", "nvfp4-bf16"])
def test_per_kv_head_scales(pair):
    check(make_case(pair, [7, 43, 20], [7, 1, 1], 4, 2, 64, per_head_scales=True, seed=6))


def test_fp16_query():
    check(make_case("bf16-fp8", [7, 43, 20], [7, 33, 1], 4, 2, 80, q_dtype=torch.float16, seed=7))


def test_fp32_query():
    check(make_case("nvfp4-bf16", [7, 20], [7, 1], 4, 2, 64, q_dtype=torch.float32, seed=8))


@pytest.mark.parametrize("pair", ["fp8-nvfp4", "bf16-fp8"])
def test_split_kv(pair):
    # One long sequence and a short one, their contexts cut in 2 chunks, then merged.
    args = make_case(pair, [45, 9], [1, 1], 8, 2, 64, page=16, seed=9)
    check(args, num_splits=2)
    check(args, window=20, num_splits=2)


@pytest.mark.parametrize("fields", [{"KEYS_FIRST": True}, {"PREFETCH_PAGES": True}, {"WORD_SCALES": True}],
                         ids=lambda f: "-".join(f))
def test_tile_variants(fields):
    # Scores as (K @ q^T)^T; block-table entries one iteration ahead; NVFP4 block scales read
    # through their aligned 32-bit words (an NVFP4 K side, then an NVFP4 V side).
    from kvfuse.ops.triton import attention as ta

    tiles = ta.DEFAULT_TILES.replace(**fields)
    check(make_case("nvfp4-fp8", [40, 7], [1, 7], 4, 2, 64, seed=10), tiles=tiles)
    check(make_case("fp8-nvfp4", [40, 7], [1, 7], 4, 2, 64, seed=11), window=12, tiles=tiles)


def test_padded_side_offset_and_linear_v_scales():
    # Page 5: the K side's 5 * 2 rows of 68 bytes end at byte 680, the V side starts at 688 (the
    # next 16-byte boundary), and NVFP4 V block scales stay linear (no 4-token interleave).
    args = make_case("pth-nvfp4", [1, 13, 9], [1, 2, 9], 4, 2, 64, page=5, seed=12)
    layout = cache_layout(args["kv_quant_mode"], args["kv_cache"], 64, torch.bfloat16)
    assert layout.side_offsets == (0, 688)
    check(args)
    check(args, window=4)


def test_tiles_for_mixed_formats():
    """Mixed decode takes the FP8 tile when both sides are byte-wide or narrower, the bf16 one otherwise."""
    from kvfuse.ops.triton import attention as ta

    decode = ta.DEFAULT_TILES.decode
    fp8_nvfp4 = KVFormat(KVQuantMode.FP8_E4M3, KVQuantMode.NVFP4)
    bf16_fp8 = KVFormat(KVQuantMode.NONE, KVQuantMode.FP8_E4M3)
    assert ta._pick_config(64, 64, 128, 4, fp8_nvfp4) == (decode["small_fp8"], True)
    assert ta._pick_config(64, 64, 128, 4, fp8_nvfp4, split=True) == (decode["small_fp8_split"], True)
    assert ta._pick_config(64, 64, 128, 4, bf16_fp8) == (decode["small"], True)
    assert ta._pick_config(64, 64, 256, 4, fp8_nvfp4) == (decode["large"], True)
    assert ta._pick_config(4096, 2, 128, 4, fp8_nvfp4) == (ta.DEFAULT_TILES.prefill["small"], False)


def test_new_token_prefill_declines_mixed_formats():
    """A prefill call that hands over the step's K/V (as layers do) runs the paged kernel for a mixed
    cache: its cached bytes are not the model-dtype K/V."""
    from kvfuse.ops.triton import prefill

    args = make_case("bf16-fp8", [7, 43], [7, 33], 2, 1, 64, seed=13)
    step = torch.zeros(40, 1, 64, dtype=torch.bfloat16, device=DEVICE)
    call = AttentionCall(**args, key=step, value=step)
    assert not prefill.takes(call, decode=False)
    assert not prefill.takes(AttentionCall(**dict(args, kv_quant_mode=args["kv_quant_mode"].code), key=step,
                                           value=step), decode=False)
    check(dict(args, key=step, value=step))


def test_through_op_with_forced_backend(monkeypatch):
    """The registry routes mixed-format attention to Triton (its declaration), and the op runs."""
    monkeypatch.setenv("KVFUSE_ATTENTION_BACKEND", "triton")
    registry.clear_cache()
    try:
        args = make_case("fp8-nvfp4", [9, 21], [1, 4], 4, 2, 64, seed=14)
        fmt = args["kv_quant_mode"]
        assert registry.select("paged_attention", DEVICE, fmt)[0] == "triton"
        out = torch.ops.kvfuse.paged_attention(*dict(args, kv_quant_mode=fmt.code).values(), "model.layers.0")
        expected = reference.paged_attention(AttentionCall(**args))
        atol, rtol = tolerances(args, 21)
        torch.testing.assert_close(out[:5].float(), expected[:5].float(), atol=atol, rtol=rtol)
    finally:
        registry.clear_cache()


# ----------------------------------------------------------------------------- GPU, realistic shapes


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
@pytest.mark.parametrize("pair", ["fp8-nvfp4", "bf16-fp8"])
def test_gpu_prefill_and_decode(pair, head_size):
    # Prefills of 7, 533 and 4099 tokens (the last over 4 pages of prefix), then a batch of 16 decodes.
    check(make_case(pair, [7, 533, 4163], [7, 533, 4099], 16, 4, head_size, page=16, seed=20))
    lens = [(331 * i) % 4099 + 1 for i in range(16)]
    check(make_case(pair, lens, [1] * 16, 32, 8, head_size, page=16, seed=21))
    check(make_case(pair, lens, [1] * 16, 32, 8, head_size, page=16, seed=22), window=1000)
