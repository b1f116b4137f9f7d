"""Triton encode / cache-write kernels against the pure-PyTorch reference, bit for bit.

On a CPU host the kernels run under the Triton interpreter (small shapes); on a GPU the same
checks run at odd and large shapes (``-m gpu``). Caches are pre-filled with a sentinel byte so
that padding tokens (slot -1) and slots nobody wrote are proven untouched.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton picks interpreted vs compiled when a kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from kvfuse.kv_cache import (KVQuantMode, logical_cache_rows, nvfp4_row_dim, nvfp4_v_scales_swizzled,  # noqa: E402
                             read_cache_rows, row_dim_for)
from kvfuse.ops import registry as backends  # noqa: E402
from kvfuse.ops import reference as ref  # noqa: E402
from kvfuse.ops.triton import kv_write as tcw  # noqa: E402

from _cache_formats import FORMAT_IDS, FORMATS, SENTINEL, sentinel_cache  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")



def _sentinel_cache(shape, dtype) -> torch.Tensor:
    return sentinel_cache(shape, dtype, DEVICE)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bit equality, except that a NaN may be any NaN for native (bf16/fp16/fp32) dtypes.

    PyTorch itself writes different NaN bit patterns on CPU and CUDA for native casts; FP8 and
    NVFP4 bytes must match exactly.
    """
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    if actual.dtype.is_floating_point and actual.dtype.itemsize > 1:
        both_nan = actual.isnan() & expected.isnan()
        differ = (_bits(actual).view(actual.shape[:-1] + (-1, actual.dtype.itemsize)) !=
                  _bits(expected).view(expected.shape[:-1] + (-1, expected.dtype.itemsize))).any(-1)
        differ &= ~both_nan
    else:
        differ = _bits(actual) != _bits(expected)
    count = int(differ.sum())
    assert count == 0, f"{what}: {count} elements differ from the reference (first at {differ.nonzero()[:4].tolist()})"


def _inputs(num_tokens, heads, head_size, dtype, specials=True):
    key = torch.randn(num_tokens, heads, head_size, device=DEVICE, dtype=torch.float32) * 4
    value = torch.randn(num_tokens, heads, head_size, device=DEVICE, dtype=torch.float32) * 300
    if specials and num_tokens >= 3 and head_size >= 16:
        key[0, 0, 0] = float("nan")
        key[1, 0, 5] = float("inf")
        value[1, -1, 3] = -float("inf")
        value[2, 0, 7] = -0.0
        key[2, -1, :16] = 0.0  # an all-zero NVFP4 block: scale 0, codes 0
        value[0, 0, 1] = 1e-30  # underflows every format
    return key.to(dtype), value.to(dtype)


def _slots(num_tokens, capacity, slot_dtype, pad_every=5):
    slots = torch.randperm(capacity, device=DEVICE)[:num_tokens]
    if num_tokens > 2:
        slots[::pad_every] = -1
    return slots.to(slot_dtype)


def _scales(mode):
    if mode is KVQuantMode.NVFP4:
        return (torch.tensor(0.37, device=DEVICE), torch.tensor(21.0, device=DEVICE))
    if mode.is_fp8:
        return (torch.tensor(0.0625, device=DEVICE), torch.tensor(1.7, device=DEVICE))
    return (torch.tensor(1.0, device=DEVICE), torch.tensor(1.0, device=DEVICE))


def _padded_sentinel_cache(shape, dtype, page_pad: int) -> torch.Tensor:
    """A sentinel cache whose pages lie ``page_pad`` bytes apart beyond their own size (stride(0)
    free, pages contiguous): the layout must come from the strides, not from ``shape``."""
    if page_pad == 0:
        return _sentinel_cache(shape, dtype)
    page = shape[1] * shape[2] * shape[3] * shape[4] * dtype.itemsize
    raw = _sentinel_cache((shape[0], page + page_pad), torch.uint8)
    return raw[:, :page].view(dtype).view(shape[0], *shape[1:])


def _assert_unwritten_slots_sentinel(cache, slots, what):
    """Every byte of every logical row (K and V) of a slot outside ``slots`` still holds the sentinel."""
    num_blocks, _, block_size = cache.shape[:3]
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=cache.device)
    written[slots.long()[slots.long() >= 0]] = True
    rows = logical_cache_rows(cache)
    untouched = _bits(rows).view(num_blocks, 2, block_size, -1).transpose(1, 2).reshape(
        num_blocks * block_size, -1)[~written]
    assert untouched.numel() > 0 or bool(written.all()), what
    assert bool((untouched == SENTINEL).all()), f"{what}: a slot outside slot_mapping was written"


def _check_fused(num_tokens, heads, head_size, mode, cache_dtype, in_dtype, slot_dtype, block_size=16, page_pad=0):
    key, value = _inputs(num_tokens, heads, head_size, in_dtype)
    k_scale, v_scale = _scales(mode)
    num_blocks = (2 * num_tokens + block_size - 1) // block_size + 1
    slots = _slots(num_tokens, num_blocks * block_size, slot_dtype)
    shape = (num_blocks, 2, block_size, heads, row_dim_for(mode, head_size))
    expected = _padded_sentinel_cache(shape, cache_dtype, page_pad)
    actual = _padded_sentinel_cache(shape, cache_dtype, page_pad)
    ref.encode_and_cache_write(key, value, expected, slots, k_scale, v_scale, int(mode))
    tcw.encode_and_cache_write(key, value, actual, slots, k_scale, v_scale, int(mode))
    what = f"encode_and_cache_write {mode.name} {cache_dtype} T={num_tokens} D={head_size} page={block_size}"
    _assert_same_bits(actual, expected, what)
    if page_pad:  # the gaps between pages are nobody's
        size = actual.element_size()
        raw = torch.empty(0, dtype=torch.uint8, device=actual.device).set_(actual.untyped_storage())
        gaps = raw.as_strided((num_blocks, page_pad), (actual.stride(0) * size, 1),
                              (actual.storage_offset() + actual[0].numel()) * size)
        assert bool((gaps == SENTINEL).all()), f"{what}: bytes between pages were written"
    # The sentinel survives everywhere the slot mapping does not point (padding included).
    _assert_unwritten_slots_sentinel(actual, slots, what)
    return key, value, slots, actual


# ----------------------------------------------------------------------------- CPU (interpreter) + GPU


@pytest.mark.parametrize("mode,cache_dtype", FORMATS, ids=FORMAT_IDS)
def test_fused_matches_reference(mode, cache_dtype):
    for head_size, slot_dtype in ((64, torch.int64), (80, torch.int32)):
        _check_fused(7, 2, head_size, mode, cache_dtype, torch.bfloat16, slot_dtype, block_size=4)


@pytest.mark.parametrize("in_dtype", [torch.float16, torch.float32], ids=["fp16_in", "fp32_in"])
@pytest.mark.parametrize("mode,cache_dtype", FORMATS, ids=FORMAT_IDS)
def test_other_input_dtypes(mode, cache_dtype, in_dtype):
    """Native caches of another dtype than the input store converted values (never raw bits)."""
    _check_fused(5, 3, 32 if mode is not KVQuantMode.NVFP4 else 48, mode, cache_dtype, in_dtype,
                 torch.int64, block_size=4)


@pytest.mark.parametrize("mode,cache_dtype", FORMATS, ids=FORMAT_IDS)
def test_encode_kv_and_cache_write(mode, cache_dtype):
    """The unfused pair gives the same rows and the same cache as the reference."""
    key, value = _inputs(7, 2, 48, torch.bfloat16)
    k_scale, _ = _scales(mode)
    rows = tcw.encode_kv(key, k_scale, int(mode), cache_dtype)
    expected_rows = ref.encode_kv(key, k_scale, int(mode), cache_dtype)
    _assert_same_bits(rows, expected_rows, f"encode_kv {mode.name}")
    vrows = ref.encode_kv(value, k_scale, int(mode), cache_dtype)
    slots = _slots(7, 24, torch.int32)
    shape = (6, 2, 4, 2, row_dim_for(mode, 48))
    expected = _sentinel_cache(shape, cache_dtype)
    actual = expected.clone()
    ref.cache_write(expected_rows, vrows, expected, slots)
    tcw.cache_write(expected_rows, vrows, actual, slots)
    _assert_same_bits(actual, expected, f"cache_write {mode.name}")


# ----------------------------------------------------------------------------- NVFP4 page layout


def _page_by_formula(shape, slots, k_rows, v_rows) -> torch.Tensor:
    """A sentinel NVFP4 cache with ``k_rows`` / ``v_rows`` placed by the page layout's formulas,
    written out here independently of :func:`kvfuse.kv_cache.nvfp4_page_index`."""
    num_blocks, _, T, H, F = shape
    D = F * 16 // 9
    half, S = D // 2, D // 16
    swizzled = T % 4 == 0 and S % 4 == 0
    pages = torch.full((num_blocks, 2, T * H * F), SENTINEL, dtype=torch.uint8)
    for t_in, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        blk, t = divmod(slot, T)
        for side, rows in ((0, k_rows), (1, v_rows)):
            row_bytes = rows[t_in].cpu()
            for h in range(H):
                base = (t * H + h) * half
                pages[blk, side, base: base + half] = row_bytes[h, :half]
                for j in range(S):
                    if side == 1 and swizzled:
                        t2, s2 = 4 * (t // 4) + j // (S // 4), 4 * (j % (S // 4)) + t % 4
                    else:
                        t2, s2 = t, j
                    pages[blk, side, T * H * half + (t2 * H + h) * S + s2] = row_bytes[h, half + j]
    return pages.view(shape).to(DEVICE)


@pytest.mark.parametrize("block_size", [16, 4, 5], ids=lambda b: f"page{b}")
@pytest.mark.parametrize("head_size", [64, 80, 128], ids=lambda d: f"d{d}")
def test_nvfp4_page_layout(head_size, block_size):
    """Fused encode+write and cache_write of encoded rows put each NVFP4 row's data and block
    scales where the page layout says (V scales interleaved for d64/d128 at pages of 4 and 16,
    linear otherwise), leave every other slot's bytes alone and match the reference."""
    heads = 3 if block_size == 5 else 2
    mode = KVQuantMode.NVFP4
    assert nvfp4_v_scales_swizzled(block_size, head_size) == (block_size % 4 == 0 and head_size % 64 == 0)
    # Pages apart (a padded stride(0)) where the page is small: the kernels take the strides.
    page_pad = 0 if block_size == 16 else 24
    key, value, slots, fused = _check_fused(9, heads, head_size, mode, torch.uint8, torch.bfloat16, torch.int64,
                                            block_size=block_size, page_pad=page_pad)
    k_scale, v_scale = _scales(mode)
    k_rows = ref.encode_kv(key, k_scale, int(mode), torch.uint8)
    v_rows = ref.encode_kv(value, v_scale, int(mode), torch.uint8)
    _assert_same_bits(fused, _page_by_formula(fused.shape, slots, k_rows, v_rows), "pages vs the layout formulas")
    valid = slots.long() >= 0
    blocks, offsets = slots.long()[valid] // block_size, slots.long()[valid] % block_size
    _assert_same_bits(read_cache_rows(fused, blocks, offsets, 0), k_rows[valid], "K rows read back")
    _assert_same_bits(read_cache_rows(fused, blocks, offsets, 1), v_rows[valid], "V rows read back")
    copied = _padded_sentinel_cache(fused.shape, torch.uint8, page_pad)
    tcw.cache_write(k_rows, v_rows, copied, slots.to(torch.int32))
    _assert_same_bits(copied, fused, "cache_write of encoded rows vs the fused write")
    _assert_unwritten_slots_sentinel(copied, slots, "cache_write")


def test_nvfp4_rows_stay_rows_in_encode_kv():
    """encode_kv's dense output keeps the per-row [data | scales] format at any head count."""
    key, _ = _inputs(6, 5, 128, torch.float16)
    scale = torch.tensor(0.25, device=DEVICE)
    rows = tcw.encode_kv(key[:, 1:4], scale, int(KVQuantMode.NVFP4), torch.uint8)
    assert rows.shape == (6, 3, nvfp4_row_dim(128))
    _assert_same_bits(rows, ref.encode_kv(key[:, 1:4], scale, int(KVQuantMode.NVFP4), torch.uint8), "rows")


def test_nvfp4_cache_not_page_contiguous_is_refused():
    """A cache whose pages are not one contiguous run cannot hold the page layout: refused,
    naming its strides, and left untouched."""
    num_blocks, block_size, heads, head_size = 3, 4, 2, 64
    row = nvfp4_row_dim(head_size)
    cache = _sentinel_cache((num_blocks, block_size, 2, heads, row), torch.uint8).transpose(1, 2)
    before = cache.clone()
    key, value = _inputs(3, heads, head_size, torch.bfloat16)
    one = torch.tensor(1.0, device=DEVICE)
    slots = torch.tensor([0, 5, 9], device=DEVICE)
    with pytest.raises(ValueError, match=r"NVFP4 caches need contiguous pages; its strides \(.*\) are not contiguous"):
        tcw.encode_and_cache_write(key, value, cache, slots, one, one, int(KVQuantMode.NVFP4))
    rows = ref.encode_kv(key, one, int(KVQuantMode.NVFP4), torch.uint8)
    with pytest.raises(ValueError, match=r"kv_cache \(3, 2, 4, 2, 36\): NVFP4 caches need contiguous pages"):
        tcw.cache_write(rows, rows, cache, slots)
    assert torch.equal(cache, before)


def test_fp8_rounding_edges():
    """Every e4m3 / e5m2 tie, subnormals, the saturation edge and specials, exactly as PyTorch rounds."""
    for mode, dtype in ((KVQuantMode.FP8_E4M3, torch.float8_e4m3fn), (KVQuantMode.FP8_E5M2, torch.float8_e5m2)):
        codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        finite = codes[torch.isfinite(codes)].unique()
        mids = (finite[1:] + finite[:-1]) / 2  # exact ties, in float32
        nudged = torch.cat([mids, torch.nextafter(mids, finite[1:]), torch.nextafter(mids, finite[:-1])])
        extra = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 464.0, 500.0, 6e4, 1e9, -1e9,
                              float("inf"), -float("inf"), float("nan")])
        x = torch.cat([finite, nudged, -nudged, extra])
        pad = (-x.numel()) % 16
        x = torch.cat([x, torch.zeros(pad)]).reshape(-1, 1, 16).to(DEVICE)
        one = torch.tensor(1.0, device=DEVICE)
        expected = ref.encode_kv(x, one, int(mode), dtype)
        actual = tcw.encode_kv(x, one, int(mode), dtype)
        _assert_same_bits(actual, expected, f"{mode.name} rounding edges")


def test_nvfp4_rounding_edges():
    """E2M1 thresholds exactly at and next to every tie, per block with a known scale."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    vals = torch.cat([ties, torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1),
                      torch.tensor([6.0, 7.0, 0.0, -0.0, -0.1, float("nan")])])
    blocks = []
    for i in range(0, vals.numel(), 15):  # 6.0 in every block pins the block scale to 1 (gs = 1)
        chunk = vals[i:i + 15]
        block = torch.cat([torch.tensor([6.0]), chunk, torch.zeros(15 - chunk.numel())])
        blocks += [block, -block]
    x = torch.stack(blocks).reshape(-1, 1, 16).to(DEVICE)
    one = torch.tensor(1.0, device=DEVICE)
    expected = ref.encode_kv(x, one, int(KVQuantMode.NVFP4), torch.uint8)
    actual = tcw.encode_kv(x, one, int(KVQuantMode.NVFP4), torch.uint8)
    _assert_same_bits(actual, expected, "nvfp4 rounding edges")


def test_zero_tokens_and_all_padding():
    cache = _sentinel_cache((2, 2, 4, 2, 32), torch.bfloat16)
    before = cache.clone()
    one = torch.tensor(1.0, device=DEVICE)
    empty = torch.empty(0, 2, 32, device=DEVICE, dtype=torch.bfloat16)
    tcw.encode_and_cache_write(empty, empty, cache, torch.empty(0, dtype=torch.int64, device=DEVICE), one, one, 0)
    x = torch.randn(3, 2, 32, device=DEVICE, dtype=torch.bfloat16)
    tcw.encode_and_cache_write(x, x, cache, torch.full((3,), -1, device=DEVICE), one, one, 0)
    assert torch.equal(_bits(cache), _bits(before))
    assert tcw.encode_kv(empty, one, 0, torch.bfloat16).shape == (0, 2, 32)


def test_through_the_op(monkeypatch):
    """``torch.ops.kvfuse.encode_and_cache_write`` runs these kernels when the triton backend is chosen."""
    if DEVICE == "cpu":
        monkeypatch.setenv("KVFUSE_CACHE_WRITE_BACKEND", "triton")
    backends.clear_cache()
    try:
        mode = KVQuantMode.FP8_E4M3
        name, fn = backends.select("encode_and_cache_write", DEVICE, int(mode))
        if DEVICE == "cuda" and name != "triton":  # a native build may be preferred; force ours
            monkeypatch.setenv("KVFUSE_CACHE_WRITE_BACKEND", "triton")
            backends.clear_cache()
            name, fn = backends.select("encode_and_cache_write", DEVICE, int(mode))
        assert name == "triton" and fn is tcw.encode_and_cache_write
        key, value = _inputs(7, 2, 64, torch.bfloat16)
        k_scale, v_scale = _scales(mode)
        slots = _slots(7, 32, torch.int64)
        expected = _sentinel_cache((8, 2, 4, 2, 64), torch.float8_e4m3fn)
        actual = expected.clone()
        ref.encode_and_cache_write(key, value, expected, slots, k_scale, v_scale, int(mode))
        torch.ops.kvfuse.encode_and_cache_write(key, value, actual, slots, k_scale, v_scale, int(mode), "l.0")
        _assert_same_bits(actual, expected, "op")
        rows = torch.ops.kvfuse.encode_kv(key, k_scale, int(mode), torch.float8_e4m3fn, "l.0")
        _assert_same_bits(rows, ref.encode_kv(key, k_scale, int(mode), torch.float8_e4m3fn), "op encode_kv")
        vrows = ref.encode_kv(value, v_scale, int(mode), torch.float8_e4m3fn)
        name, fn = backends.select("cache_write", DEVICE, int(mode))
        assert name == "triton" and fn is tcw.cache_write  # not the submodule of the same name
        actual.view(torch.uint8).fill_(SENTINEL)
        torch.ops.kvfuse.cache_write(rows, vrows, actual, slots, int(mode), "l.0")
        _assert_same_bits(actual, expected, "op cache_write")
    finally:
        backends.clear_cache()


# ----------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_tokens,head_size,slot_dtype", [
    (7, 128, torch.int64), (533, 64, torch.int32), (533, 80, torch.int64), (533, 128, torch.int32),
    (533, 256, torch.int64), (16384, 128, torch.int32), (16384, 128, torch.int64),
], ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("mode,cache_dtype", FORMATS, ids=FORMAT_IDS)
def test_gpu_fused_bit_exact(num_tokens, head_size, slot_dtype, mode, cache_dtype):
    _check_fused(num_tokens, 8, head_size, mode, cache_dtype, torch.bfloat16, slot_dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode,cache_dtype", FORMATS, ids=FORMAT_IDS)
def test_gpu_unfused_and_odd_heads(mode, cache_dtype):
    for heads, head_size in ((1, 128), (5, 80), (12, 64)):
        _check_fused(533, heads, head_size, mode, cache_dtype, torch.float16, torch.int64, block_size=32)
        key, _ = _inputs(533, heads, head_size, torch.bfloat16)
        scale = _scales(mode)[1]
        _assert_same_bits(tcw.encode_kv(key, scale, int(mode), cache_dtype),
                          ref.encode_kv(key, scale, int(mode), cache_dtype), "encode_kv")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode,dtype", [FORMATS[0], FORMATS[3], FORMATS[4]], ids=["bf16", "e4m3", "e5m2"])
def test_gpu_software_rounding_matches_hardware(mode, dtype):
    """The integer rounding used under the interpreter gives the hardware convert's bits."""
    x = (torch.randn(4096, 8, 128, device="cuda") * torch.logspace(-12, 18, 128, base=2.0, device="cuda"))
    scale = torch.tensor(0.75, device="cuda")
    hardware = tcw.encode_kv(x, scale, int(mode), dtype)
    software = tcw.encode_kv(x, scale, int(mode), dtype, soft_rounding=True)
    _assert_same_bits(software, hardware, "software vs hardware rounding")
    _assert_same_bits(hardware, ref.encode_kv(x, scale, int(mode), dtype), "hardware rounding vs reference")


def _check_scales(num_tokens, heads, head_size, scales):
    """FP8 and NVFP4 over scales from tiny to huge, inputs over 48 binades, specials included."""
    gen = torch.Generator(device=DEVICE).manual_seed(1234)
    x = torch.randn(num_tokens, heads, head_size, device=DEVICE, generator=gen)
    x *= torch.logspace(-24, 24, head_size, base=2.0, device=DEVICE)
    x[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    for scale in scales:
        s = torch.tensor(scale, device=DEVICE, dtype=torch.float32)
        for mode, dtype in ((KVQuantMode.FP8_E4M3, torch.float8_e4m3fn), (KVQuantMode.FP8_E5M2, torch.float8_e5m2),
                            (KVQuantMode.NVFP4, torch.uint8)):
            if scale == 0 and mode.is_fp8:
                # 0/0's NaN sign differs between CPU and CUDA PyTorch; only NaN-ness is defined.
                got = tcw.encode_kv(x, s, int(mode), dtype).float()
                want = ref.encode_kv(x, s, int(mode), dtype).float()
                assert torch.equal(got.isnan(), want.isnan())
                assert torch.equal(got[~got.isnan()], want[~want.isnan()])
                continue
            _assert_same_bits(tcw.encode_kv(x, s, int(mode), dtype), ref.encode_kv(x, s, int(mode), dtype),
                              f"{mode.name} scale={scale}")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy at 1e-35
def test_scales_across_range():
    _check_scales(16, 2, 64, [0.05, 0.37, 1.0, 3.3e-7, 7e5, 1e-35, 1e35, 0.0])


@pytest.mark.gpu
@gpu
def test_gpu_scales_across_range():
    scales = torch.exp(torch.empty(24).uniform_(-30, 30, generator=torch.Generator().manual_seed(7))).tolist()
    _check_scales(16384, 8, 128, scales + [1.0, 0.1, 1 / 3, 1e-38, 1e38, 0.0])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode,cache_dtype", [FORMATS[3], FORMATS[5]], ids=["e4m3", "nvfp4"])
def test_gpu_cache_beyond_int32_offsets(mode, cache_dtype):
    """Slots whose byte offset exceeds 2**31 land where the reference puts them (fused and, for
    NVFP4, cache_write of encoded rows)."""
    heads, head_size, block_size = 8, 128, 16
    row = row_dim_for(mode, head_size)
    num_blocks = (2**31) // (2 * block_size * heads * row) + 64  # > 2**31 bytes
    cache = torch.zeros(num_blocks, 2, block_size, heads, row, dtype=cache_dtype, device="cuda")
    last = num_blocks * block_size
    slots = torch.tensor([last - 1, 3, last - 40, -1, last - 17 * 16], device="cuda", dtype=torch.int64)
    key, value = _inputs(5, heads, head_size, torch.bfloat16)
    one = torch.tensor(1.0, device="cuda")
    rows_k = ref.encode_kv(key, one, int(mode), cache_dtype)
    rows_v = ref.encode_kv(value, one, int(mode), cache_dtype)
    valid = slots >= 0
    blocks, offsets = slots[valid] // block_size, slots[valid] % block_size
    for writer in ("fused", "cache_write") if mode is KVQuantMode.NVFP4 else ("fused",):
        cache.view(torch.uint8).index_fill_(0, blocks, 0)  # the previous writer's rows are gone
        if writer == "fused":
            tcw.encode_and_cache_write(key, value, cache, slots, one, one, int(mode))
        else:
            tcw.cache_write(rows_k, rows_v, cache, slots)
        _assert_same_bits(read_cache_rows(cache, blocks, offsets, 0), rows_k[valid], "K rows")
        _assert_same_bits(read_cache_rows(cache, blocks, offsets, 1), rows_v[valid], "V rows")
    del cache
    torch.cuda.empty_cache()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size,page_pad", [(16, 0), (32, 8), (5, 0), (4, 40)])
@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
def test_gpu_nvfp4_pages(block_size, page_pad, head_size):
    """NVFP4 pages at realistic token counts, pages apart (alignments 16 and 8), odd pages."""
    for heads in (8, 3):
        key, value, slots, fused = _check_fused(533, heads, head_size, KVQuantMode.NVFP4, torch.uint8,
                                                torch.bfloat16, torch.int32, block_size=block_size,
                                                page_pad=page_pad)
        k_scale, v_scale = _scales(KVQuantMode.NVFP4)
        k_rows = ref.encode_kv(key, k_scale, int(KVQuantMode.NVFP4), torch.uint8)
        v_rows = ref.encode_kv(value, v_scale, int(KVQuantMode.NVFP4), torch.uint8)
        copied = _padded_sentinel_cache(fused.shape, torch.uint8, page_pad)
        tcw.cache_write(k_rows, v_rows, copied, slots)
        _assert_same_bits(copied, fused, f"cache_write vs fused, d{head_size} page{block_size} heads={heads}")


@pytest.mark.gpu
@gpu
def test_gpu_op_picks_triton_when_native_is_absent():
    backends.clear_cache()
    name, _ = backends.select("encode_and_cache_write", "cuda", int(KVQuantMode.NVFP4))
    native_reason = backends.unavailable_reason("native", "encode_and_cache_write", "cuda", 3)
    assert name == ("triton" if native_reason is not None else "native"), native_reason
