"""The kvfuse ops on CPU (reference backend) against expectations computed independently here.

Caches are pre-filled with a sentinel so that padding slots (-1) and every slot nobody wrote
are proven untouched; attention caches are pre-filled with NaN bytes so that reading a page
or a position outside a sequence poisons the output.
"""

import math

import pytest
import torch

from kvfuse import KVQuantMode
from kvfuse.kv_cache import (E2M1_VALUES, NVFP4_BLOCK, logical_cache_rows, nvfp4_dequantize_reference, row_dim_for,
                             write_cache_rows)
from kvfuse.ops import cache_write, encode_and_cache_write, encode_kv, paged_attention

from _cache_formats import FORMAT_IDS, FORMATS, SENTINEL, sentinel_cache

HEAD_SIZES = [64, 80, 128, 256]

OPS = torch.ops.kvfuse


pytestmark = pytest.mark.usefixtures("reference_backend")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(shape, dtype, seed, scale=1.0):
    return (torch.randn(shape, generator=_gen(seed)) * scale).to(dtype)


def _sentinel_cache(num_blocks, block_size, heads, row_dim, dtype, byte=SENTINEL):
    return sentinel_cache((num_blocks, 2, block_size, heads, row_dim), dtype, byte=byte)


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


# ----------------------------------------------------------------------------- encodings by hand


def _nvfp4_by_hand(x, global_scale):
    """NVFP4 rows by nearest-value search (ties to the even code): independent of the threshold form."""
    head_size = x.shape[-1]
    lead = x.shape[:-1]
    xb = x.float().reshape(-1, head_size // NVFP4_BLOCK, NVFP4_BLOCK)
    amax = torch.nan_to_num(xb.abs(), nan=0.0).amax(-1)
    scale = torch.clamp(amax / (global_scale * 6.0), max=448.0).to(torch.float8_e4m3fn)
    denom = scale.float().unsqueeze(-1) * global_scale
    # The contract since the reciprocal encode: one correctly rounded 1 / denom per block, a product per element.
    q = xb * torch.where(denom > 0, 1.0 / denom, torch.zeros_like(denom))
    mags = torch.tensor(E2M1_VALUES)
    dist = (q.abs().unsqueeze(-1) - mags).abs()
    best = dist == dist.min(-1, keepdim=True).values
    even = best & (torch.arange(8) % 2 == 0)
    code = torch.where(even.any(-1), even.int().argmax(-1), best.int().argmax(-1))
    code = code | ((q < 0).int() << 3)
    code = code.reshape(-1, head_size).to(torch.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    rows = torch.cat([packed, scale.view(torch.uint8).reshape(-1, head_size // NVFP4_BLOCK)], dim=-1)
    return rows.reshape(*lead, -1)


def _encode_by_hand(x, scale, mode, dtype):
    if mode is KVQuantMode.NONE:
        return x.to(dtype)
    if mode is KVQuantMode.NVFP4:
        return _nvfp4_by_hand(x, float(scale))
    limit = torch.finfo(dtype).max
    return torch.clamp(x.float() / float(scale), -limit, limit).to(dtype)


# ----------------------------------------------------------------------------- encode_kv


@pytest.mark.parametrize("num_tokens", [7, 533])
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("mode,dtype", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_encode_kv_matches_hand_computation(mode, dtype, head_size, num_tokens, x_dtype):
    x = _randn((num_tokens, 3, head_size), x_dtype, seed=num_tokens * head_size, scale=4.0)
    scale = torch.tensor(0.37 if mode.is_quantized else 1.0)
    rows = encode_kv(x, scale, mode, dtype, "model.layers.0.attn")
    assert rows.dtype == dtype
    assert rows.shape == (num_tokens, 3, row_dim_for(mode, head_size))
    assert torch.equal(_bits(rows), _bits(_encode_by_hand(x, scale, mode, dtype)))
    assert rows.data_ptr() != x.data_ptr()


def test_encode_kv_fp8_saturates_and_keeps_nan():
    x = torch.tensor([1e5, -1e5, float("nan"), 448.0, 449.0]).reshape(5, 1, 1).expand(5, 1, 16).contiguous()
    rows = encode_kv(x, torch.tensor(1.0), KVQuantMode.FP8_E4M3, torch.float8_e4m3fn).float()[:, 0, 0]
    assert rows[[0, 1, 3, 4]].tolist() == [448.0, -448.0, 448.0, 448.0]
    assert torch.isnan(rows[2])


def test_encode_kv_accepts_non_contiguous_heads():
    # A slice of a fused qkv projection: rows strided, last dim contiguous.
    qkv = _randn((7, 5, 64), torch.bfloat16, seed=3)
    k = qkv[:, 1:3]
    rows = encode_kv(k, torch.tensor(0.5), KVQuantMode.FP8_E5M2, torch.float8_e5m2)
    assert torch.equal(_bits(rows), _bits(_encode_by_hand(k, 0.5, KVQuantMode.FP8_E5M2, torch.float8_e5m2)))


# ----------------------------------------------------------------------------- cache_write


def _slots(num_tokens, num_slots, seed, slot_dtype, pad_every=7):
    slots = torch.randperm(num_slots, generator=_gen(seed))[:num_tokens]
    slots[::pad_every] = -1  # padding tokens, first token included
    return slots.to(slot_dtype)


def _expected_after_write(cache, key_rows, value_rows, slots):
    expected = cache.clone()
    block_size = cache.shape[2]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block_size, 0, slot % block_size] = key_rows[t]
            expected[slot // block_size, 1, slot % block_size] = value_rows[t]
    return expected


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_tokens", [7, 533])
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("mode,dtype", FORMATS, ids=FORMAT_IDS)
def test_cache_write_scatters_rows_and_leaves_the_rest(mode, dtype, head_size, num_tokens, slot_dtype):
    heads, block_size = 2, 16
    num_blocks = -(-num_tokens * 3 // 2 // block_size)  # a third of the slots stay unwritten
    row_dim = row_dim_for(mode, head_size)
    key = _randn((num_tokens, heads, head_size), torch.bfloat16, seed=1, scale=3.0)
    value = _randn((num_tokens, heads, head_size), torch.bfloat16, seed=2, scale=3.0)
    key_rows = _encode_by_hand(key, 0.5, mode, dtype)
    value_rows = _encode_by_hand(value, 2.0, mode, dtype)
    slots = _slots(num_tokens, num_blocks * block_size, seed=num_tokens, slot_dtype=slot_dtype)
    cache = _sentinel_cache(num_blocks, block_size, heads, row_dim, dtype)
    expected = _expected_after_write(cache, key_rows, value_rows, slots)

    cache_write(key_rows, value_rows, cache, slots, mode, "model.layers.0.attn")

    rows = logical_cache_rows(cache)
    assert torch.equal(_bits(rows), _bits(expected))
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0].long()] = True
    untouched = rows.transpose(1, 2).reshape(num_blocks * block_size, -1)[~written]
    assert untouched.numel() > 0 and (_bits(untouched) == SENTINEL).all()


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_cache_write_all_padding_writes_nothing(slot_dtype):
    rows = _randn((5, 2, 64), torch.bfloat16, seed=0)
    cache = _sentinel_cache(2, 4, 2, 64, torch.bfloat16)
    cache_write(rows, rows, cache, torch.full((5,), -1, dtype=slot_dtype), KVQuantMode.NONE)
    assert (_bits(cache) == SENTINEL).all()


@pytest.mark.parametrize("num_tokens", [7, 533])
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("mode,dtype", FORMATS, ids=FORMAT_IDS)
def test_fused_equals_encode_then_write_bit_for_bit(mode, dtype, head_size, num_tokens):
    heads, block_size = 3, 16
    num_blocks = -(-num_tokens * 2 // block_size)
    key = _randn((num_tokens, heads, head_size), torch.float16, seed=11, scale=5.0)
    value = _randn((num_tokens, heads, head_size), torch.float16, seed=12, scale=0.1)
    k_scale, v_scale = torch.tensor(0.25), torch.tensor(0.01)
    slots = _slots(num_tokens, num_blocks * block_size, seed=5, slot_dtype=torch.int64, pad_every=5)
    row_dim = row_dim_for(mode, head_size)
    fused = _sentinel_cache(num_blocks, block_size, heads, row_dim, dtype)
    unfused = fused.clone()
    encode_and_cache_write(key, value, fused, slots, k_scale, v_scale, mode, "model.layers.1.attn")
    cache_write(encode_kv(key, k_scale, mode, dtype), encode_kv(value, v_scale, mode, dtype), unfused, slots, mode)
    assert torch.equal(_bits(fused), _bits(unfused))
    by_hand = _expected_after_write(_sentinel_cache(num_blocks, block_size, heads, row_dim, dtype),
                                    _encode_by_hand(key, k_scale, mode, dtype),
                                    _encode_by_hand(value, v_scale, mode, dtype), slots)
    assert torch.equal(_bits(logical_cache_rows(fused)), _bits(by_hand))


# ----------------------------------------------------------------------------- validation


def _fp8_setup():
    cache = _sentinel_cache(4, 8, 2, 64, torch.float8_e4m3fn)
    rows = _encode_by_hand(_randn((7, 2, 64), torch.bfloat16, seed=0), 1.0, KVQuantMode.FP8_E4M3,
                           torch.float8_e4m3fn)
    return cache, rows, torch.arange(7)


@pytest.mark.parametrize("case,match", [
    ("bf16 rows into fp8 cache", r"key_rows.dtype=torch.bfloat16 differs from kv_cache.dtype=torch.float8_e4m3fn"),
    ("e5m2 rows into e4m3 cache", r"key_rows.dtype=torch.float8_e5m2 differs"),
    ("uint8 rows into e4m3 cache", r"key_rows.dtype=torch.uint8 differs"),
    ("row_dim", r"key_rows rows are \(2, 48\).*holds \(2, 64\)"),
    ("heads", r"key_rows rows are \(1, 64\)"),
    ("mode", r"kv_cache.dtype=torch.float8_e4m3fn cannot hold kv_quant_mode=FP8_E5M2"),
    ("bad mode", r"kv_quant_mode=7 is not one of"),
    ("slots length", r"slot_mapping has 6 entries but there are 7 tokens"),
    ("slots dtype", r"slot_mapping must be 1-D int32 or int64, got dtype torch.float32"),
    ("value tokens", r"key_rows has 7 tokens but value_rows has 6"),
])
def test_cache_write_refuses_bad_rows_without_touching_the_cache(case, match):
    cache, rows, slots = _fp8_setup()
    key, value, mode = rows, rows, KVQuantMode.FP8_E4M3
    if case == "bf16 rows into fp8 cache":
        key = rows.float().bfloat16()
    elif case == "e5m2 rows into e4m3 cache":
        key = rows.float().to(torch.float8_e5m2)
    elif case == "uint8 rows into e4m3 cache":
        key = rows.view(torch.uint8)
    elif case == "row_dim":
        key = rows[..., :48].contiguous()
    elif case == "heads":
        key = rows[:, :1].contiguous()
    elif case == "mode":
        mode = KVQuantMode.FP8_E5M2
    elif case == "bad mode":
        mode = 7
    elif case == "slots length":
        slots = slots[:6]
    elif case == "slots dtype":
        slots = slots.float()
    elif case == "value tokens":
        value = rows[:6]
    with pytest.raises(ValueError, match=match) as info:
        cache_write(key, value, cache, slots, mode, "model.layers.4.attn")
    assert "model.layers.4.attn" in str(info.value)
    assert (_bits(cache) == SENTINEL).all()


@pytest.mark.parametrize("case,match", [
    ("cache dtype", r"cache_dtype=torch.float8_e5m2 cannot hold kv_quant_mode=FP8_E4M3"),
    ("native cache for fp8", r"cache_dtype=torch.bfloat16 cannot hold kv_quant_mode=FP8_E4M3"),
    ("nvfp4 head size", r"head_size=72 must be a multiple of 16 for NVFP4"),
    ("scale dtype", r"scale must be a float32 tensor with one element"),
    ("x dtype", r"x.dtype=torch.int32 is not one of"),
    ("x rank", r"x must be \[num_tokens, num_heads, head_size\]"),
])
def test_encode_kv_validation(case, match):
    x, scale, mode, dtype = _randn((7, 2, 64), torch.bfloat16, seed=0), torch.tensor(1.0), KVQuantMode.FP8_E4M3, \
        torch.float8_e4m3fn
    if case == "cache dtype":
        dtype = torch.float8_e5m2
    elif case == "native cache for fp8":
        dtype = torch.bfloat16
    elif case == "nvfp4 head size":
        x, mode, dtype = _randn((7, 2, 72), torch.bfloat16, seed=0), KVQuantMode.NVFP4, torch.uint8
    elif case == "scale dtype":
        scale = torch.tensor(1.0, dtype=torch.float64)
    elif case == "x dtype":
        x = torch.ones(7, 2, 64, dtype=torch.int32)
    elif case == "x rank":
        x = x.reshape(7, 128)
    with pytest.raises(ValueError, match=match):
        encode_kv(x, scale, mode, dtype, "model.layers.0.attn")


def test_fused_validation_leaves_cache_untouched():
    cache = _sentinel_cache(4, 8, 2, 36, torch.uint8)
    key = _randn((7, 2, 64), torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match=r"kv_cache.dtype=torch.uint8 cannot hold kv_quant_mode=FP8_E4M3"):
        encode_and_cache_write(key, key, cache, torch.arange(7), torch.tensor(1.0), torch.tensor(1.0),
                               KVQuantMode.FP8_E4M3, "l")
    with pytest.raises(ValueError, match=r"needs \(2, 72\)"):
        encode_and_cache_write(key.repeat(1, 1, 2), key.repeat(1, 1, 2), cache, torch.arange(7), torch.tensor(1.0),
                               torch.tensor(1.0), KVQuantMode.NVFP4, "l")
    assert (_bits(cache) == SENTINEL).all()


# ----------------------------------------------------------------------------- opcheck


def _opcheck(op, args, dtype):
    if dtype.itemsize == 1 and dtype.is_floating_point:
        # opcheck's test_schema compares tensors with torch.allclose, which has no FP8 kernel on
        # CPU; the mutation check it would do is made by hand: only (a!) arguments may change.
        before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        op(*args)
        mutable = {i for i, arg in enumerate(op._schema.arguments) if arg.alias_info and arg.alias_info.is_write}
        for i, (old, new) in enumerate(zip(before, args)):
            if isinstance(old, torch.Tensor) and i not in mutable:
                assert torch.equal(_bits(old), _bits(new)), f"{op} mutated argument {i} without declaring it"
        utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    else:
        utils = "ALL"
    torch.library.opcheck(op, args, test_utils=utils)


@pytest.mark.parametrize("mode,dtype", FORMATS, ids=FORMAT_IDS)
def test_opcheck_every_op(mode, dtype):
    heads, head_size, block_size, num_blocks = 2, 32, 4, 6
    row_dim = row_dim_for(mode, head_size)
    key = _randn((7, heads, head_size), torch.bfloat16, seed=1)
    value = _randn((7, heads, head_size), torch.bfloat16, seed=2)
    scale = torch.tensor(0.5)
    slots = torch.tensor([3, -1, 0, 9, 22, 15, -1])
    cache = torch.zeros(num_blocks, 2, block_size, heads, row_dim, dtype=dtype)
    _opcheck(OPS.encode_kv.default, (key, scale, int(mode), dtype, "l0"), dtype)
    rows = encode_kv(key, scale, mode, dtype)
    _opcheck(OPS.cache_write.default, (rows, rows, cache, slots, int(mode), "l0"), dtype)
    _opcheck(OPS.encode_and_cache_write.default, (key, value, cache, slots, scale, scale, int(mode), "l0"), dtype)
    encode_and_cache_write(key, value, cache, torch.arange(7), scale, scale, mode)
    query = _randn((5, 4, head_size), torch.bfloat16, seed=3)
    block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([7, 3], dtype=torch.int32)
    qsl = torch.tensor([0, 3, 4], dtype=torch.int32)
    for window in (None, 2):
        _opcheck(OPS.paged_attention.default,
                 (query, cache, scale, scale, block_table, seq_lens, qsl, int(mode), 0.125, window, "l0"), dtype)


@pytest.mark.parametrize("mode,dtype", [(KVQuantMode.NONE, torch.bfloat16), (KVQuantMode.FP8_E4M3, torch.float8_e4m3fn)],
                         ids=["bf16", "fp8"])
def test_ops_with_outputs_are_inference_only_under_grad_mode(mode, dtype):
    # Inputs that require grad: the ops run below autograd (their Autograd kernel), so no output
    # claims a gradient, no fallback warning is raised, and opcheck's autograd-registration check
    # finds the kernel.
    import warnings

    head_size, heads = 32, 2
    key = _randn((5, heads, head_size), torch.bfloat16, seed=4).requires_grad_()
    scale = torch.tensor(0.5, requires_grad=True)
    cache = torch.zeros(4, 2, 4, heads, row_dim_for(mode, head_size), dtype=dtype)
    encode_and_cache_write(key.detach(), key.detach(), cache, torch.arange(5), scale.detach(), scale.detach(), mode)
    query = _randn((3, 4, head_size), torch.bfloat16, seed=5).requires_grad_()
    attn_args = (query, cache, scale, scale, torch.tensor([[0, 1]], dtype=torch.int32),
                 torch.tensor([5], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), int(mode), 0.125,
                 None, "l0")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*autograd kernel was not registered.*")
        rows = OPS.encode_kv.default(key, scale, int(mode), dtype, "l0")
        out = OPS.paged_attention.default(*attn_args)
    assert not rows.requires_grad and rows.grad_fn is None
    assert not out.requires_grad and out.grad_fn is None
    with torch.no_grad():
        expected = OPS.paged_attention.default(query.detach(), *attn_args[1:])
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    for op, args in ((OPS.encode_kv.default, (key, scale, int(mode), dtype, "l0")),
                     (OPS.paged_attention.default, attn_args)):
        torch.library.opcheck(op, args, test_utils=("test_autograd_registration", "test_faketensor",
                                                    "test_aot_dispatch_dynamic"))


# ----------------------------------------------------------------------------- attention


def _decode_cache_rows(rows, scale, mode):
    if mode is KVQuantMode.NONE:
        return rows.float()
    if mode is KVQuantMode.NVFP4:
        return nvfp4_dequantize_reference(rows, scale)
    return rows.float() * float(scale)


def _naive_attention(query, kv_cache, k_scale, v_scale, block_table, seq_lens, qsl, mode, sm_scale, window):
    """Per sequence, per query row, per head, fp32: the textbook definition with explicit positions."""
    num_tokens, num_q_heads, head_size = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.zeros(num_tokens, num_q_heads, head_size)
    for b in range(len(seq_lens)):
        seq_len = int(seq_lens[b])
        start, end = int(qsl[b]), int(qsl[b + 1])
        q_len = end - start
        pages = block_table[b].tolist()
        rows = logical_cache_rows(kv_cache)
        keys = torch.stack([rows[pages[p // block_size], 0, p % block_size] for p in range(seq_len)])
        vals = torch.stack([rows[pages[p // block_size], 1, p % block_size] for p in range(seq_len)])
        keys = _decode_cache_rows(keys, k_scale, mode)  # [L, Hkv, D]
        vals = _decode_cache_rows(vals, v_scale, mode)
        for i in range(q_len):
            pos = seq_len - q_len + i
            visible = [j for j in range(seq_len) if j <= pos and (window is None or pos - j < window)]
            for h in range(num_q_heads):
                kv_head = h * num_kv_heads // num_q_heads
                q = query[start + i, h].float()
                scores = torch.stack([q @ keys[j, kv_head] for j in visible]) * sm_scale
                weights = torch.exp(scores - scores.max())
                weights = weights / weights.sum()
                out[start + i, h] = sum(w * vals[j, kv_head] for w, j in zip(weights, visible))
    return out


def _attention_case(mode, dtype, head_size, q_lens, seq_lens, num_q_heads, num_kv_heads, pad_rows, seed,
                    q_dtype=torch.bfloat16, block_size=4):
    """A NaN-filled cache whose sequences own shuffled pages holding encoded random K/V."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # 3 pages nobody owns
    max_blocks = max(blocks_per_seq) + 1
    cache = _sentinel_cache(num_blocks, block_size, num_kv_heads, row_dim_for(mode, head_size), dtype, byte=0xFF)
    order = torch.randperm(num_blocks, generator=_gen(seed)).tolist()
    # Unused block-table entries point at a page nobody owns (NaN): reading them would show.
    block_table = torch.full((len(seq_lens), max_blocks), order[-1], dtype=torch.int32)
    k_scale, v_scale = torch.tensor(0.8), torch.tensor(1.3)
    for b, n in enumerate(seq_lens):
        pages = [order.pop(0) for _ in range(blocks_per_seq[b])]
        block_table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        k = _randn((n, num_kv_heads, head_size), torch.bfloat16, seed=seed + 10 * b + 1, scale=2.0)
        v = _randn((n, num_kv_heads, head_size), torch.bfloat16, seed=seed + 10 * b + 2, scale=2.0)
        for p in range(n):
            page, off = pages[p // block_size], p % block_size
            at = (torch.tensor([page]), torch.tensor([off]))
            write_cache_rows(cache, *at, 0, _encode_by_hand(k[p : p + 1], k_scale, mode, dtype))
            write_cache_rows(cache, *at, 1, _encode_by_hand(v[p : p + 1], v_scale, mode, dtype))
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    query = _randn((qsl[-1] + pad_rows, num_q_heads, head_size), q_dtype, seed=seed + 99, scale=1.5)
    return (query, cache, k_scale, v_scale, block_table, torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor(qsl, dtype=torch.int32))


BATCHES = {
    # name: (q_lens, seq_lens)
    "prefill": ([7, 1, 12], [7, 1, 12]),
    "decode": ([1, 1, 1, 1], [9, 33, 5, 1]),
    "mixed": ([4, 1, 6, 1], [10, 17, 6, 2]),  # chunked prefill with context, decode, prefill, decode
}


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa4", "mqa6"])
@pytest.mark.parametrize("mode,dtype", FORMATS, ids=FORMAT_IDS)
def test_paged_attention_matches_naive(mode, dtype, heads, window, batch):
    q_lens, seq_lens = BATCHES[batch]
    num_q_heads, num_kv_heads = heads
    head_size = 64
    args = _attention_case(mode, dtype, head_size, q_lens, seq_lens, num_q_heads, num_kv_heads, pad_rows=3,
                           seed=len(batch) + num_q_heads)
    query = args[0]
    sm_scale = head_size ** -0.5
    out = paged_attention(*args, mode, sm_scale, window, "model.layers.2.attn")
    assert out.dtype == query.dtype and out.shape == query.shape
    expected = _naive_attention(*args, mode, sm_scale, window)
    assert not torch.isnan(out).any(), "read a position or page outside the sequence"
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    num_real = sum(q_lens)
    assert (out[num_real:] == 0).all(), "padding rows must be zero"


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("mode,dtype", FORMATS, ids=FORMAT_IDS)
def test_paged_attention_head_sizes_fp32_query(mode, dtype, head_size):
    args = _attention_case(mode, dtype, head_size, [5, 1], [5, 11], 4, 2, pad_rows=2, seed=head_size,
                           q_dtype=torch.float32, block_size=8)
    sm_scale = 0.7 / math.sqrt(head_size)
    out = paged_attention(*args, mode, sm_scale, None)
    expected = _naive_attention(*args, mode, sm_scale, None)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert (out[6:] == 0).all()


def test_paged_attention_533_token_prefill_with_window():
    mode, dtype = KVQuantMode.FP8_E4M3, torch.float8_e4m3fn
    args = _attention_case(mode, dtype, 64, [300, 233], [300, 240], 4, 2, pad_rows=5, seed=533,
                           q_dtype=torch.float32, block_size=16)
    out = paged_attention(*args, mode, 0.125, 37)
    query, cache, k_scale, v_scale, block_table, seq_lens, qsl = args
    # Spot-check rows (the naive loop is slow): first, last and around the window edge of each sequence.
    rows = [0, 36, 37, 299, 300, 306, 532]
    for b, r0 in ((0, 0), (1, 300)):
        sub_rows = [r - r0 for r in rows if r0 <= r < int(qsl[b + 1])]
        q_len = int(qsl[b + 1]) - int(qsl[b])
        sub_q = query[r0 : r0 + q_len]
        expected = _naive_attention(sub_q, cache, k_scale, v_scale, block_table[b : b + 1], seq_lens[b : b + 1],
                                    torch.tensor([0, q_len]), mode, 0.125, 37)
        torch.testing.assert_close(out[r0 : r0 + q_len][sub_rows], expected[sub_rows], atol=1e-5, rtol=1e-5)
    assert (out[533:] == 0).all()


def test_sliding_window_changes_the_result():
    # Guards the window tests above against a window that is silently ignored.
    mode, dtype = KVQuantMode.NONE, torch.float32
    args = _attention_case(mode, dtype, 64, [1], [20], 2, 2, pad_rows=0, seed=1, q_dtype=torch.float32)
    full = paged_attention(*args, mode, 0.125, None)
    windowed = paged_attention(*args, mode, 0.125, 4)
    assert not torch.allclose(full, windowed)
    torch.testing.assert_close(windowed, _naive_attention(*args, mode, 0.125, 4), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case,match", [
    ("row_dim", r"row_dim=64 does not fit head_size=128"),
    ("heads", r"query has 3 heads, not a multiple of the cache's 2 KV heads"),
    ("block_table dtype", r"block_table must be \[num_seqs, max_blocks\] int32"),
    ("qsl length", r"query_start_loc has 2 entries; expected num_seqs \+ 1 = 3"),
    ("sm_scale", r"sm_scale=0.0 must be a finite float > 0"),
    ("window", r"sliding_window=0 must be None or > 0"),
])
def test_paged_attention_validation(case, match):
    args = list(_attention_case(KVQuantMode.NONE, torch.bfloat16, 64, [2, 1], [2, 3], 4, 2, pad_rows=0, seed=0))
    sm_scale, window = 0.125, None
    if case == "row_dim":
        args[0] = _randn((3, 4, 128), torch.bfloat16, seed=0)
    elif case == "heads":
        args[0] = _randn((3, 3, 64), torch.bfloat16, seed=0)
    elif case == "block_table dtype":
        args[4] = args[4].long()
    elif case == "qsl length":
        args[6] = args[6][:2]
    elif case == "sm_scale":
        sm_scale = 0.0
    elif case == "window":
        window = 0
    with pytest.raises(ValueError, match=match):
        paged_attention(*args, KVQuantMode.NONE, sm_scale, window, "model.layers.0.attn")
