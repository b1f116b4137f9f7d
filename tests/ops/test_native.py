"""Native (csrc/) kernels against the pure-PyTorch reference, bit for bit, and the C++ parser
against the Python one, message for message.

The module builds the library once (CPU, plus CUDA where nvcc and a device exist); it is
skipped with the build error when no C++ toolchain is present. Caches are pre-filled with a
sentinel byte so that padding tokens (slot -1) and slots nobody wrote are proven untouched; an
NVFP4 slot's bytes are spread over its page (kvfuse.kv_cache.nvfp4_page_index), so those checks
read the slots' logical rows.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys

from pathlib import Path

import pytest
import torch

from kvfuse.kv_cache import (KVQuantMode, logical_cache_rows, nvfp4_v_scales_swizzled, read_cache_rows, row_dim_for,
                             storage_dtype)
from kvfuse import envs
from kvfuse import ops as kv_ops
from kvfuse.ops import registry as backends
from kvfuse.ops import native
from kvfuse.ops import reference as ref

from _cache_formats import SENTINEL, sentinel_cache

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HEAD_SIZES = (64, 80, 128, 256)  # all multiples of 16, so NVFP4 runs on every one


@pytest.fixture(scope="module", autouse=True)
def built():
    if native._disabled():
        pytest.skip("KVFUSE_NATIVE=0")
    reason = native.unavailable_reason("encode_kv", "cpu", 0)
    if reason is not None:
        pytest.skip(f"native library unavailable here: {reason}")
    return native.build_info()


# ----------------------------------------------------------------------------- parser and enum

def test_cpp_enum_matches_python():
    assert native.mode_values() == {m.name: m.value for m in KVQuantMode}


# ----------------------------------------------------------------------------- helpers


def _sentinel_cache(num_blocks, block_size, heads, row_dim, dtype, device):
    return sentinel_cache((num_blocks, 2, block_size, heads, row_dim), dtype, device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(*t.shape, t.dtype.itemsize)


def _assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Same bytes everywhere; where the reference holds a NaN, any NaN (torch's own NaN bits differ
    between its vectorised and scalar paths)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    differ = (_bytes(actual) != _bytes(expected)).any(-1)
    if actual.dtype != torch.uint8:
        e_nan, a_nan = expected.float().isnan(), actual.float().isnan()
        assert torch.equal(e_nan, a_nan), f"{what}: NaN positions differ"
        differ &= ~e_nan
    count = int(differ.sum())
    assert count == 0, f"{what}: {count} elements differ (first at {differ.nonzero()[:4].tolist()})"


def _inputs(num_tokens, heads, head_size, dtype, device, strided):
    """K and V with special values; strided=True makes them views into one fused [T, 3, H, D] buffer."""
    shape = (num_tokens, 3, heads, head_size) if strided else (2, num_tokens, heads, head_size)
    buf = torch.randn(shape, device=device) * torch.logspace(-3, 3, head_size, device=device)
    if num_tokens >= 3:
        flat = buf.view(-1)
        idx = torch.randperm(flat.numel(), device=device)[:12]
        flat[idx] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e6, -1e6, 3e-41, -0.0, 0.0,
                                  448.0, 464.0, 57344.0, 0.3125], device=device)
    buf = buf.to(dtype)
    if strided:
        return buf[:, 1], buf[:, 2]
    return buf[0], buf[1]


def _slots(num_tokens, capacity, dtype, device):
    slots = torch.randperm(capacity, device=device)[:num_tokens]
    pad = torch.rand(num_tokens, device=device) < 0.15
    return torch.where(pad, torch.full_like(slots, -1), slots).to(dtype)


def _scales(mode, device):
    if mode is KVQuantMode.NVFP4:
        return torch.tensor(0.0137, device=device), torch.tensor(1.7, device=device)
    return torch.tensor(0.37, device=device), torch.tensor(3.1, device=device)


CASES = [  # (mode, input dtype, cache dtype)
    (KVQuantMode.NONE, torch.bfloat16, torch.bfloat16),
    (KVQuantMode.NONE, torch.float32, torch.float16),
    (KVQuantMode.NONE, torch.float16, torch.float32),
    (KVQuantMode.FP8_E4M3, torch.bfloat16, torch.float8_e4m3fn),
    (KVQuantMode.FP8_E4M3, torch.float32, torch.float8_e4m3fn),
    (KVQuantMode.FP8_E5M2, torch.float16, torch.float8_e5m2),
    (KVQuantMode.NVFP4, torch.bfloat16, torch.uint8),
    (KVQuantMode.NVFP4, torch.float32, torch.uint8),
]
CASE_IDS = ["bf16", "f32->f16", "f16->f32", "e4m3-bf16", "e4m3-f32", "e5m2-f16", "nvfp4-bf16", "nvfp4-f32"]


def _assert_untouched(cache, slots, what="a padding or unrelated slot was written"):
    """Every slot that no non-negative entry of ``slots`` names still holds the sentinel (in its
    logical rows: an NVFP4 slot's bytes lie in several places of its page)."""
    num_blocks, _, block_size = cache.shape[:3]
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=cache.device)
    written[slots[slots >= 0].long()] = True
    rows = _bytes(logical_cache_rows(cache))
    untouched = rows.permute(0, 2, 1, 3, 4, 5).reshape(num_blocks * block_size, -1)[~written]
    assert bool((untouched == SENTINEL).all()), what


def _check_fused(mode, in_dtype, cache_dtype, num_tokens, head_size, device, slot_dtype=torch.int64,
                 strided=True, heads=2, block_size=16, through_op=False):
    key, value = _inputs(num_tokens, heads, head_size, in_dtype, device, strided)
    num_blocks = (num_tokens * 3 // 2) // block_size + 2
    slots = _slots(num_tokens, num_blocks * block_size, slot_dtype, device)
    k_scale, v_scale = _scales(mode, device)
    row_dim = row_dim_for(mode, head_size)
    cache = _sentinel_cache(num_blocks, block_size, heads, row_dim, cache_dtype, device)
    expected = cache.clone()
    ref.encode_and_cache_write(key, value, expected, slots, k_scale, v_scale, mode)
    if through_op:
        torch.ops.kvfuse.encode_and_cache_write(key, value, cache, slots, k_scale, v_scale, int(mode), "layers.0")
    else:
        native.encode_and_cache_write(key, value, cache, slots, k_scale, v_scale, mode)
    _assert_same(cache, expected, f"{mode.name} {in_dtype}->{cache_dtype} T={num_tokens} D={head_size}")
    # Not implied by the comparison alone if the reference were wrong too: unwritten slots keep the sentinel.
    _assert_untouched(cache, slots)


# ----------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("mode,in_dtype,cache_dtype", CASES, ids=CASE_IDS)
def test_cpu_fused_matches_reference(mode, in_dtype, cache_dtype, head_size):
    _check_fused(mode, in_dtype, cache_dtype, 533, head_size, "cpu")


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("mode,in_dtype,cache_dtype", CASES, ids=CASE_IDS)
def test_cpu_few_tokens_slot_dtypes_contiguous(mode, in_dtype, cache_dtype, slot_dtype):
    _check_fused(mode, in_dtype, cache_dtype, 7, 80, "cpu", slot_dtype=slot_dtype, strided=False, heads=3,
                 block_size=5)


@pytest.mark.parametrize("mode,in_dtype,cache_dtype", CASES[:6], ids=CASE_IDS[:6])
def test_cpu_odd_head_size(mode, in_dtype, cache_dtype):
    _check_fused(mode, in_dtype, cache_dtype, 7, 12, "cpu")


@pytest.mark.parametrize("mode,in_dtype,cache_dtype", CASES, ids=CASE_IDS)
def test_cpu_encode_kv_and_cache_write_match_reference(mode, in_dtype, cache_dtype):
    key, value = _inputs(33, 2, 64, in_dtype, "cpu", strided=True)
    k_scale, v_scale = _scales(mode, "cpu")
    k_rows = native.encode_kv(key, k_scale, mode, cache_dtype)
    _assert_same(k_rows, ref.encode_kv(key, k_scale, mode, cache_dtype), "encode_kv")
    assert k_rows.is_contiguous() and k_rows.data_ptr() != key.data_ptr()
    v_rows = ref.encode_kv(value, v_scale, mode, cache_dtype)
    cache = _sentinel_cache(5, 8, 2, row_dim_for(mode, 64), cache_dtype, "cpu")
    expected = cache.clone()
    slots = _slots(33, 40, torch.int32, "cpu")
    ref.cache_write(k_rows, v_rows, expected, slots)
    native.cache_write(k_rows, v_rows, cache, slots)
    _assert_same(cache, expected, "cache_write")


# ----------------------------------------------------------------------------- NVFP4 page layout

# (block_size, head_size): V scales interleaved where block_size % 4 == 0 and (head_size / 16) % 4 == 0
# (16 and 4 with 64 / 128 / 256), linear otherwise (block size 5; head size 80 at every block size).
NVFP4_PAGES = [(b, d) for b in (16, 4, 5) for d in HEAD_SIZES]


def _check_nvfp4_page(block_size, head_size, device, in_dtype=torch.bfloat16, heads=3, num_tokens=29,
                      page_gap=1, row_offset=0):
    """Fused write, encode_kv and cache_write, native against the reference, into a sentinel cache
    whose pages lie ``page_gap`` page sides apart (stride(0) is free; dims 1-4 are the page), from
    encoded rows that start ``row_offset`` bytes into their buffer (unaligned copies)."""
    mode = KVQuantMode.NVFP4
    key, value = _inputs(num_tokens, heads, head_size, in_dtype, device, strided=True)
    num_blocks = -(-num_tokens * 3 // 2) // block_size + 2
    slots = _slots(num_tokens, num_blocks * block_size, torch.int32, device)
    k_scale, v_scale = _scales(mode, device)
    row_dim = row_dim_for(mode, head_size)
    what = f"NVFP4 block_size={block_size} D={head_size} H={heads} on {device}"

    def cache_pair():
        buf = sentinel_cache((num_blocks, 2 + page_gap, block_size, heads, row_dim), torch.uint8, device)
        return buf, buf[:, :2]

    expected_buf, expected = cache_pair()
    ref.encode_and_cache_write(key, value, expected, slots, k_scale, v_scale, mode)
    fused_buf, fused = cache_pair()
    native.encode_and_cache_write(key, value, fused, slots, k_scale, v_scale, mode)
    _assert_same(fused_buf, expected_buf, f"fused {what}")
    _assert_untouched(fused, slots)

    k_rows = native.encode_kv(key, k_scale, mode, torch.uint8)
    v_rows = native.encode_kv(value, v_scale, mode, torch.uint8)
    _assert_same(k_rows, ref.encode_kv(key, k_scale, mode, torch.uint8), f"encode_kv {what}")
    _assert_same(v_rows, ref.encode_kv(value, v_scale, mode, torch.uint8), f"encode_kv {what}")
    if row_offset:
        def shifted(rows):
            raw = torch.zeros(rows.numel() + row_offset, dtype=torch.uint8, device=device)
            view = raw[row_offset:].view(rows.shape)
            view.copy_(rows)
            return view
        k_rows, v_rows = shifted(k_rows), shifted(v_rows)
    copied_buf, copied = cache_pair()
    native.cache_write(k_rows, v_rows, copied, slots)
    _assert_same(copied_buf, expected_buf, f"cache_write {what}")
    # The rows land where the format says: read back through the layout, they are the encoded rows.
    valid = slots >= 0
    blocks, offsets = slots[valid].long() // block_size, slots[valid].long() % block_size
    _assert_same(read_cache_rows(copied, blocks, offsets, 1), v_rows[valid], f"V rows read back {what}")


@pytest.mark.parametrize("block_size,head_size", NVFP4_PAGES)
def test_cpu_nvfp4_page_layouts(block_size, head_size):
    _check_nvfp4_page(block_size, head_size, "cpu")


def test_cpu_nvfp4_page_by_the_formula():
    """One interleaved page written natively and checked byte by byte against the layout's formulas,
    independently of kvfuse.kv_cache.nvfp4_page_index (which the reference uses)."""
    T, H, D = 8, 2, 128
    half, S = D // 2, D // 16
    assert nvfp4_v_scales_swizzled(T, D)
    key, value = _inputs(T, H, D, torch.float32, "cpu", strided=False)
    k_scale, v_scale = _scales(KVQuantMode.NVFP4, "cpu")
    cache = _sentinel_cache(1, T, H, half + S, torch.uint8, "cpu")
    native.encode_and_cache_write(key, value, cache, torch.arange(T), k_scale, v_scale, KVQuantMode.NVFP4)
    page = cache.view(2, -1)
    for side, (x, scale) in enumerate(((key, k_scale), (value, v_scale))):
        rows = ref.encode_kv(x, scale, KVQuantMode.NVFP4, torch.uint8)
        for t in range(T):
            for h in range(H):
                data_at = (t * H + h) * half
                assert torch.equal(page[side, data_at:data_at + half], rows[t, h, :half]), (side, t, h)
                for j in range(S):
                    if side == 0:
                        at = T * H * half + (t * H + h) * S + j
                    else:
                        t_row, col = 4 * (t // 4) + j // (S // 4), 4 * (j % (S // 4)) + t % 4
                        at = T * H * half + (t_row * H + h) * S + col
                    assert int(page[side, at]) == int(rows[t, h, half + j]), (side, t, h, j)


def _paged_nvfp4_refusal_case(device):
    """An NVFP4 cache whose heads are a slice of wider pages: rows not contiguous within a page."""
    key, value = _inputs(5, 2, 64, torch.bfloat16, device, strided=False)
    buf = _sentinel_cache(3, 4, 3, row_dim_for(KVQuantMode.NVFP4, 64), torch.uint8, device)
    k_scale, v_scale = _scales(KVQuantMode.NVFP4, device)
    return key, value, buf, buf[:, :, :, :2], torch.arange(5, device=device), k_scale, v_scale


def test_cpu_refuses_nvfp4_cache_not_contiguous_within_a_page():
    key, value, buf, cache, slots, k_scale, v_scale = _paged_nvfp4_refusal_case("cpu")
    before = buf.clone()
    with pytest.raises(ValueError, match=r"strides \[864, 432, 108, 36, 1\] are not contiguous within a page "
                                         r"\(dims 1-4 must have strides \(288, 72, 36, 1\)\)"):
        native.encode_and_cache_write(key, value, cache, slots, k_scale, v_scale, KVQuantMode.NVFP4)
    rows = ref.encode_kv(key, k_scale, KVQuantMode.NVFP4, torch.uint8)
    with pytest.raises(ValueError, match="not contiguous within a page"):
        native.cache_write(rows, rows, cache, slots)
    with pytest.raises(ValueError, match=r"row_dim=35 is not an NVFP4 row width"):
        native.cache_write(rows[..., :35], rows[..., :35], buf[..., :35].contiguous(), slots)
    # Through the public op the validator's message explains it in the op's terms.
    with pytest.raises(ValueError, match=r"encode_and_cache_write.*not contiguous within a page.*allocate_kv_cache"):
        torch.ops.kvfuse.encode_and_cache_write(key, value, cache, slots, k_scale, v_scale, 3, "layers.0")
    assert torch.equal(buf, before)


def test_cpu_public_op_runs_native_when_forced(monkeypatch):
    monkeypatch.setenv("KVFUSE_CACHE_WRITE_BACKEND", "native")
    backends.clear_cache()
    try:
        assert backends.select("encode_and_cache_write", "cpu", KVQuantMode.NVFP4)[0] == "native"
        _check_fused(KVQuantMode.NVFP4, torch.bfloat16, torch.uint8, 7, 64, "cpu", through_op=True)
        _check_fused(KVQuantMode.FP8_E4M3, torch.bfloat16, torch.float8_e4m3fn, 7, 64, "cpu", through_op=True)
    finally:
        backends.clear_cache()


def test_cpu_out_of_range_slot_raises_before_writing():
    key, value = _inputs(4, 1, 16, torch.float32, "cpu", strided=False)
    cache = _sentinel_cache(1, 4, 1, 16, torch.float32, "cpu")
    before = cache.clone()
    with pytest.raises(IndexError, match="outside the cache"):
        native.encode_and_cache_write(key, value, cache, torch.tensor([0, 1, 2, 4]), torch.tensor(1.0),
                                      torch.tensor(1.0), 0)
    assert torch.equal(_bytes(cache), _bytes(before))


def test_cpu_zero_tokens_is_a_no_op():
    key = torch.empty(0, 2, 64)
    cache = _sentinel_cache(2, 4, 2, 64, torch.float8_e4m3fn, "cpu")
    before = cache.clone()
    native.encode_and_cache_write(key, key, cache, torch.empty(0, dtype=torch.int64), torch.tensor(1.0),
                                  torch.tensor(1.0), KVQuantMode.FP8_E4M3)
    assert torch.equal(_bytes(cache), _bytes(before))
    assert native.encode_kv(key, torch.tensor(1.0), KVQuantMode.NVFP4, torch.uint8).shape == (0, 2, 36)


# ----------------------------------------------------------------------------- build, fallback, switches


def test_build_info_names_the_build(built):
    assert built["built"] is True and os.path.isfile(built["library"])
    assert torch.__version__.split("+")[0].replace(".", "_") in built["build_dir"]
    if built["cuda"]:
        major, minor = torch.cuda.get_device_capability()
        assert built["gencode"].endswith(f"sm_{major}{minor}{'a' if major == 9 else ''}")
    else:
        assert built["cuda_error"]
        assert "CUDA kernels were not built" in native.unavailable_reason("encode_kv", "cuda", 0)


def test_disabled_by_env(monkeypatch):
    monkeypatch.setenv("KVFUSE_NATIVE", "0")
    backends.clear_cache()
    assert "KVFUSE_NATIVE=0" in native.unavailable_reason("encode_kv", "cpu", 0)
    assert native.build_info()["enabled"] is False
    monkeypatch.setenv("KVFUSE_CACHE_WRITE_BACKEND", "native")
    backends.clear_cache()
    try:
        with pytest.raises(RuntimeError, match="KVFUSE_NATIVE=0"):
            backends.select("encode_kv", "cpu", 0)
        monkeypatch.delenv("KVFUSE_CACHE_WRITE_BACKEND")
        backends.clear_cache()
        assert backends.select("encode_kv", "cpu", 0)[0] == "reference"
    finally:
        backends.clear_cache()


def test_build_after_a_killed_build_does_not_wait_on_its_baton(monkeypatch, tmp_path, caplog):
    """A build killed mid-way leaves torch's ``lock`` baton in its directory; the next build must
    remove it (under kvfuse's own file lock) before torch's loader would wait on it forever."""
    from filelock import FileLock, Timeout
    from torch.utils import cpp_extension

    monkeypatch.setenv("KVFUSE_NATIVE_BUILD_DIR", str(tmp_path))
    envs.reload(_clear_registry=False)
    try:
        build_dir = tmp_path / f"kvfuse_native_{native._tag(None)}"
        build_dir.mkdir()
        (build_dir / "lock").touch()
        (build_dir / "build.ninja").write_text("kept")
        seen = {}

        def load(**kwargs):
            seen["baton"] = (Path(kwargs["build_directory"]) / "lock").exists()
            try:  # kvfuse's own lock is held by _compile: another holder cannot take it
                FileLock(str(build_dir) + ".lock", timeout=0).acquire()
                seen["lock_held"] = False
            except Timeout:
                seen["lock_held"] = True
            return str(build_dir / "lib.so")

        monkeypatch.setattr(cpp_extension, "load", load)
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            library, where = native._compile(Path(native.__file__).parent, None)
        assert seen == {"baton": False, "lock_held": True}
        assert where == build_dir and library == str(build_dir / "lib.so")
        assert (build_dir / "build.ninja").read_text() == "kept"
        assert any("did not finish" in r.getMessage() and str(build_dir / "lock") in r.getMessage()
                   for r in caplog.records)
    finally:
        monkeypatch.delenv("KVFUSE_NATIVE_BUILD_DIR")
        envs.reload(_clear_registry=False)


def test_failed_build_falls_back_with_reason(monkeypatch):
    def no_compiler(csrc, gencode):
        raise RuntimeError("Error building extension: g++: command not found")

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_ops", {})
    monkeypatch.setattr(native, "_compile", no_compiler)
    reason = native.unavailable_reason("encode_and_cache_write", "cpu", 1)
    assert "building csrc/ failed" in reason and "g++: command not found" in reason
    with pytest.raises(RuntimeError, match="unavailable"):
        native.encode_kv(torch.zeros(1, 1, 16), torch.tensor(1.0), 0, torch.float32)
    backends.clear_cache()
    try:
        assert backends.select("encode_and_cache_write", "cpu", 1)[0] == "reference"
    finally:
        backends.clear_cache()


def test_native_rejects_other_ops_and_devices():
    assert "runs on CUDA, not on cpu" in backends.unavailable_reason("native", "paged_attention", "cpu", 3)
    assert "mps" in backends.unavailable_reason("native", "encode_kv", "mps", 0)
    # Its attention kernels read every mode (bf16 caches: the prefill kernel only), so what is left
    # on a host without a CUDA build is the build.
    reason = backends.unavailable_reason("native", "paged_attention", "cuda", int(KVQuantMode.NONE))
    assert reason is None or "NONE" not in reason
    # Per-token-head FP8: the fused write and attention, on CUDA only.
    pth = int(KVQuantMode.FP8_PER_TOKEN_HEAD)
    for op in ("encode_kv", "cache_write"):
        assert f"not for {op}" in backends.unavailable_reason("native", op, "cuda", pth)
    for op in ("encode_and_cache_write", "paged_attention"):
        assert "on CUDA, not on cpu" in backends.unavailable_reason("native", op, "cpu", pth)


def test_decode_heads_per_block_follows_the_kernels_head_groups():
    from kvfuse.ops.registry import AttentionCall

    pth = KVQuantMode.FP8_PER_TOKEN_HEAD

    def call(mode, heads, cache=None):
        cache = torch.zeros(4, 2, 16, heads, row_dim_for(mode, 128), dtype=storage_dtype(mode, torch.bfloat16)) \
            if cache is None else cache
        return AttentionCall(torch.zeros(1, 2 * heads, 128, dtype=torch.bfloat16), cache, torch.tensor(1.0),
                             torch.tensor(1.0), torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                             torch.arange(2, dtype=torch.int32), mode, 0.1, None)

    assert native.decode_heads_per_block(call(pth, 8)) == 4
    assert native.decode_heads_per_block(call(pth, 4)) == 4
    assert native.decode_heads_per_block(call(pth, 6)) == 1
    assert native.decode_heads_per_block(call(KVQuantMode.FP8_E4M3, 8)) == 1
    # Heads sliced out of a wider cache: a slot's 4 rows are no longer one run with the next 4.
    wide = torch.zeros(4, 2, 16, 12, 132, dtype=torch.uint8)[:, :, :, :8]
    assert native.decode_heads_per_block(call(pth, 8, wide)) == 1
    # NVFP4: head pairs where the heads are even in number.
    assert native.decode_heads_per_block(call(KVQuantMode.NVFP4, 8)) == 2
    assert native.decode_heads_per_block(call(KVQuantMode.NVFP4, 2)) == 2
    assert native.decode_heads_per_block(call(KVQuantMode.NVFP4, 3)) == 1
    assert native.decode_heads_per_block(call(KVQuantMode.NVFP4, 1)) == 1


def test_native_attention_refusals_name_the_argument():
    """What the decode kernel does not take is refused with the argument, its value and what is allowed."""
    from kvfuse.ops.registry import AttentionCall

    def call(mode=KVQuantMode.NVFP4, dtype=torch.bfloat16, head_size=128, q_heads=32, tokens=4, seqs=4):
        query = torch.zeros(tokens, q_heads, head_size, dtype=dtype)
        cache = torch.zeros(8, 2, 16, 8, row_dim_for(mode, head_size), dtype=storage_dtype(mode, torch.bfloat16))
        return AttentionCall(query, cache, torch.tensor(1.0), torch.tensor(1.0), torch.zeros(seqs, 2, dtype=torch.int32),
                             torch.ones(seqs, dtype=torch.int32), torch.arange(seqs + 1, dtype=torch.int32), mode,
                             0.1, None)

    assert "query is on cpu" in native.decode_refusal(call())
    assert "kv_quant_mode=NONE" in native.decode_refusal(call(mode=KVQuantMode.NONE))
    # The remaining checks come after the device check: look at them through a CUDA-looking query.
    for kwargs, expected in (({"dtype": torch.float32}, "query dtype torch.float32"),
                             ({"head_size": 80}, "head_size=80"),
                             ({"q_heads": 8 * 17}, "17 query heads per KV head"),
                             ({"tokens": 17}, "17 query tokens for 4 sequences")):
        c = call(**kwargs)
        fake = type("FakeCuda", (), {"type": "cuda"})()
        query = type("Q", (), {"device": fake, "dtype": c.query.dtype, "shape": c.query.shape,
                               "data_ptr": lambda self: 0, "stride": lambda self: c.query.stride()})()
        reason = native.decode_refusal(dataclasses.replace(c, query=query))
        assert reason is not None and expected in reason, (kwargs, reason)


def test_import_builds_nothing():
    code = ("import kvfuse, kvfuse.ops.native as n, sys; "
            "assert n._state == {} and not n._ops; assert 'torch.utils.cpp_extension' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "KVFUSE_NATIVE": "1"})


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_tokens", [7, 533, 16384])
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("mode,in_dtype,cache_dtype", CASES, ids=CASE_IDS)
def test_cuda_fused_matches_reference(mode, in_dtype, cache_dtype, head_size, num_tokens):
    if native.unavailable_reason("encode_and_cache_write", "cuda", mode) is not None:
        pytest.skip(native.unavailable_reason("encode_and_cache_write", "cuda", mode))
    heads = 8 if num_tokens < 16384 else 4
    _check_fused(mode, in_dtype, cache_dtype, num_tokens, head_size, "cuda", heads=heads,
                 slot_dtype=torch.int32 if num_tokens == 533 else torch.int64, strided=num_tokens != 533)


# (k_scale, v_scale) for each way the FP8 write divides (csrc/cuda/cache_write.cu, Division):
# one product where both are powers of two (the fast window's edges included, and a negative one),
# the corrected reciprocal where either is not, div.rn where either lies outside [2^-64, 2^64]. In
# unpaired launches (7 and 533 tokens) each thread divides by its own half's scale alone
# (KVFUSE_FP8_OWN_DIVIDER), so the mixed pairs put key and value threads on different paths.
DIVISION_SCALES = [(1.0, 1.0), (0.5, 2.0**-20), (2.0**64, 2.0**-64), (-0.5, 8.0), (1.0, 0.37), (0.37, 3.1),
                   (2.0**65, 1.0), (3e-20, 0.37)]
DIVISION_IDS = ["one", "pow2", "pow2-window-edges", "pow2-negative", "pow2-and-other", "other", "pow2-outside",
                "tiny"]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_tokens", [7, 533, 8195])
@pytest.mark.parametrize("scales", DIVISION_SCALES, ids=DIVISION_IDS)
@pytest.mark.parametrize("mode,in_dtype,cache_dtype", [CASES[3], CASES[4], CASES[5]], ids=CASE_IDS[3:6])
def test_cuda_fp8_write_every_division(mode, in_dtype, cache_dtype, scales, num_tokens):
    """FP8 writes of special values (NaN, +-inf, +-0, a subnormal, values past the format's
    largest, random magnitudes from 1e-3 to 1e3) under every division path, bit for bit: 7 and
    533 tokens in unpaired launches, 8195 (8 heads, past KVFUSE_FP8_UNPAIRED_BELOW_ITEMS) paired."""
    if native.unavailable_reason("encode_and_cache_write", "cuda", mode) is not None:
        pytest.skip(native.unavailable_reason("encode_and_cache_write", "cuda", mode))
    key, value = _inputs(num_tokens, 8, 128, in_dtype, "cuda", strided=num_tokens != 533)
    k_scale, v_scale = (torch.tensor(s, device="cuda") for s in scales)
    num_blocks = num_tokens // 16 + 4
    cache = _sentinel_cache(num_blocks, 16, 8, 128, cache_dtype, "cuda")
    expected = cache.clone()
    slots = _slots(num_tokens, num_blocks * 16, torch.int64, "cuda")
    ref.encode_and_cache_write(key, value, expected, slots, k_scale, v_scale, mode)
    native.encode_and_cache_write(key, value, cache, slots, k_scale, v_scale, mode)
    _assert_same(cache, expected, f"{mode.name} scales {scales} T={num_tokens}")
    _assert_untouched(cache, slots)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode,in_dtype,cache_dtype", CASES, ids=CASE_IDS)
def test_cuda_unaligned_and_odd_shapes(mode, in_dtype, cache_dtype):
    """Views whose rows are not 16-byte aligned, and a head size of 12, take the scalar paths."""
    if native.unavailable_reason("encode_and_cache_write", "cuda", mode) is not None:
        pytest.skip("no CUDA kernels")
    head_size = 16 if mode is KVQuantMode.NVFP4 else 12
    buf = torch.randn(2, 7, 3, head_size + 1, device="cuda").to(in_dtype)
    key, value = buf[0, :, :, 1:], buf[1, :, :, 1:]  # storage offset of one element
    k_scale, v_scale = _scales(mode, "cuda")
    cache = _sentinel_cache(3, 4, 3, row_dim_for(mode, head_size), cache_dtype, "cuda")
    expected = cache.clone()
    slots = _slots(7, 12, torch.int32, "cuda")
    ref.encode_and_cache_write(key, value, expected, slots, k_scale, v_scale, mode)
    native.encode_and_cache_write(key, value, cache, slots, k_scale, v_scale, mode)
    _assert_same(cache, expected, "unaligned")
    rows = native.encode_kv(key, k_scale, mode, cache_dtype)
    _assert_same(rows, ref.encode_kv(key, k_scale, mode, cache_dtype), "encode_kv unaligned")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode,in_dtype,cache_dtype", CASES, ids=CASE_IDS)
def test_cuda_encode_kv_and_cache_write_match_reference(mode, in_dtype, cache_dtype):
    if native.unavailable_reason("encode_kv", "cuda", mode) is not None:
        pytest.skip("no CUDA kernels")
    key, value = _inputs(533, 8, 128, in_dtype, "cuda", strided=True)
    k_scale, _ = _scales(mode, "cuda")
    rows = native.encode_kv(key, k_scale, mode, cache_dtype)
    _assert_same(rows, ref.encode_kv(key, k_scale, mode, cache_dtype), "encode_kv")
    v_rows = ref.encode_kv(value, k_scale, mode, cache_dtype)
    cache = _sentinel_cache(40, 16, 8, row_dim_for(mode, 128), cache_dtype, "cuda")
    expected = cache.clone()
    slots = _slots(533, 640, torch.int64, "cuda")
    ref.cache_write(rows, v_rows, expected, slots)
    native.cache_write(rows, v_rows, cache, slots)
    _assert_same(cache, expected, "cache_write")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("row_offset", [0, 4, 1])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("block_size,head_size", NVFP4_PAGES)
def test_cuda_nvfp4_page_layouts(block_size, head_size, in_dtype, row_offset):
    """Every data store width (8 / 4 / 1 bytes: a page side holds block_size * 3 * row_dim bytes,
    odd for D=80 at block size 5) and every load width of the row copy (rows ``row_offset`` bytes
    off their buffer, row widths 36 / 45 / 72 / 144)."""
    if native.unavailable_reason("encode_and_cache_write", "cuda", KVQuantMode.NVFP4) is not None:
        pytest.skip("no CUDA kernels")
    _check_nvfp4_page(block_size, head_size, "cuda", in_dtype=in_dtype, row_offset=row_offset)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size", [16, 5])
def test_cuda_nvfp4_page_layouts_wide_launches(block_size):
    """Token counts whose launches take paired units and, for the row copy, two units per thread."""
    if native.unavailable_reason("encode_and_cache_write", "cuda", KVQuantMode.NVFP4) is not None:
        pytest.skip("no CUDA kernels")
    _check_nvfp4_page(block_size, 128, "cuda", heads=8, num_tokens=16384)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_cuda_nvfp4_write_special_values_in_every_lane(in_dtype):
    """16-bit inputs take the kernel's two-per-word NaN and amax path: NaN of either sign and
    payload, +-inf, -0.0, subnormals and the format's largest values at every position of a
    16-block, alone and paired with a NaN in the other half of their word, whole-NaN blocks, and
    blocks of the smallest subnormals of either sign beside the largest value."""
    if native.unavailable_reason("encode_and_cache_write", "cuda", KVQuantMode.NVFP4) is not None:
        pytest.skip("no CUDA kernels")
    tiny = torch.finfo(in_dtype).smallest_normal / 4  # a subnormal of the input type
    big = torch.finfo(in_dtype).max
    specials = [float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0, tiny, -tiny, big, -big]
    g = torch.Generator().manual_seed(5)
    rows = []
    for value in specials:
        for pos in range(16):
            for partner_nan in (False, True):
                row = torch.randn(16, generator=g) * 3
                row[pos] = value
                if partner_nan:
                    row[pos ^ 1] = float("nan")
                rows.append(row)
    rows.append(torch.full((16,), float("nan")))
    rows.append(torch.full((16,), -0.0))
    # Beside the largest value, the smallest ones scale far below the smallest code (to float32
    # subnormals for bfloat16): either sign's encodes as a zero code, 8 where q < 0; -0 as 0.
    denorm = torch.finfo(in_dtype).smallest_normal * torch.finfo(in_dtype).eps
    for pos in range(16):
        row = torch.tensor([-denorm, denorm, -0.0, 0.0] * 4)
        row[pos] = big if pos % 2 else -big
        rows.append(row)
    x = torch.stack(rows)  # (tokens, 16): one head, one block per row
    x = x.to(in_dtype).view(-1, 1, 16).cuda()
    if in_dtype == torch.bfloat16:  # a NaN with a payload that the float -> bfloat16 cast would not make
        x.view(torch.int16)[0, 0, 0] = 0x7F81
    else:
        x.view(torch.int16)[0, 0, 0] = 0x7C01
    tokens = x.shape[0]
    num_blocks = -(-tokens // 16)
    slots = torch.randperm(num_blocks * 16, device="cuda")[:tokens]
    k_scale, v_scale = _scales(KVQuantMode.NVFP4, "cuda")
    cache = _sentinel_cache(num_blocks, 16, 1, row_dim_for(KVQuantMode.NVFP4, 16), torch.uint8, "cuda")
    expected = cache.clone()
    value = x.flip(0)
    ref.encode_and_cache_write(x, value, expected, slots, k_scale, v_scale, KVQuantMode.NVFP4)
    native.encode_and_cache_write(x, value, cache, slots, k_scale, v_scale, KVQuantMode.NVFP4)
    _assert_same(cache, expected, f"NVFP4 special values, {in_dtype}")


@pytest.mark.gpu
@gpu
def test_cuda_out_of_range_slots_are_skipped_not_written():
    if native.unavailable_reason("encode_kv", "cuda", 0) is not None:
        pytest.skip("no CUDA kernels")
    key = torch.randn(3, 1, 16, device="cuda")
    cache = _sentinel_cache(1, 4, 1, 16, torch.float32, "cuda")
    native.encode_and_cache_write(key, key, cache, torch.tensor([0, 4, 1 << 40], device="cuda"),
                                  torch.tensor(1.0, device="cuda"), torch.tensor(1.0, device="cuda"), 0)
    assert torch.equal(cache[0, 0, 0], key[0]) and bool((_bytes(cache[0, :, 1:]) == SENTINEL).all())


@pytest.mark.gpu
@gpu
def test_cuda_default_backend_is_native():
    if native.unavailable_reason("encode_kv", "cuda", 0) is not None:
        pytest.skip("no CUDA kernels")
    backends.clear_cache()
    for mode in native.IMPLEMENTATION.modes:
        assert backends.select("encode_and_cache_write", "cuda", mode)[0] == "native"
        assert backends.select("encode_and_cache_write", "cuda", mode, 1)[0] == "native"
    # Per-token-head FP8: its own kernel at every size (it ties Triton's at 65536 tokens).
    for num_tokens in (None, 1, 1 << 16):
        assert backends.select("encode_and_cache_write", "cuda", KVQuantMode.FP8_PER_TOKEN_HEAD,
                               num_tokens)[0] == "native"
    assert storage_dtype(KVQuantMode.NVFP4) == torch.uint8


# ----------------------------------------------------------------------------- token-count policy


def test_native_max_tokens_env_override(monkeypatch):
    from kvfuse.ops import tuning

    backends.clear_cache()
    try:
        assert tuning.cuda_cache_write_policy("sm90").native_max_tokens(KVQuantMode.FP8_E4M3) == 1 << 62
        assert tuning.cuda_cache_write_policy("sm90").native_max_tokens(KVQuantMode.NONE) == 16384
        monkeypatch.setenv("KVFUSE_NATIVE_MAX_TOKENS", "7")
        backends.clear_cache()
        assert tuning.cuda_cache_write_policy("sm90").native_max_tokens(KVQuantMode.NVFP4) == 7
        assert tuning.cuda_cache_write_policy("sm90").native_max_tokens(KVQuantMode.NONE) == 7
        # A bad value fails when the environment is read, naming the variable.
        monkeypatch.setenv("KVFUSE_NATIVE_MAX_TOKENS", "many")
        with pytest.raises(ValueError, match="KVFUSE_NATIVE_MAX_TOKENS='many'"):
            backends.clear_cache()
    finally:
        monkeypatch.delenv("KVFUSE_NATIVE_MAX_TOKENS", raising=False)
        backends.clear_cache()


def test_cache_write_policy_tables_are_validated():
    from kvfuse.ops import tuning

    counts = {m: 16 for m in KVQuantMode}
    with pytest.raises(ValueError, match="triton_when_captured=.*positive token counts"):
        tuning.CacheWritePolicy(counts, frozenset({KVQuantMode.NVFP4}))
    with pytest.raises(ValueError, match="triton_when_captured=.*positive token counts"):
        tuning.CacheWritePolicy(counts, {KVQuantMode.NVFP4: 0})
    with pytest.raises(ValueError, match="max_tokens lacks"):
        tuning.CacheWritePolicy({KVQuantMode.NONE: 1}, {})
    policy = tuning.CacheWritePolicy(counts, {KVQuantMode.NVFP4: 100})
    assert policy.triton_captured(KVQuantMode.NVFP4, 99) and policy.triton_captured(KVQuantMode.NVFP4, None)
    assert not policy.triton_captured(KVQuantMode.NVFP4, 100) and not policy.triton_captured(KVQuantMode.NONE, 1)


def test_triton_preference_by_mode_token_count_and_capture():
    """The selection rules (native and Triton ranks) under the sm90 policy's situations."""
    from kvfuse.ops import tuning
    from kvfuse.ops.registry import Situation

    backends.clear_cache()
    policy = tuning.cuda_cache_write_policy("sm90")
    impls = backends.implementations()

    def prefers(mode, num_tokens, capturing):
        bulk = num_tokens is not None and num_tokens >= policy.native_max_tokens(mode)
        captured = not bulk and capturing and policy.triton_captured(mode, num_tokens)
        situation = Situation("encode_kv", "cuda", mode, "bulk" if bulk else "small", captured)
        return impls["triton"].rank(situation) < impls["native"].rank(situation)

    # FP8 and NVFP4: native at every size, captured or not.
    for mode in (KVQuantMode.FP8_E4M3, KVQuantMode.FP8_E5M2, KVQuantMode.NVFP4):
        for capturing in (False, True):
            for num_tokens in (None, 1, 1023, 1024, 1 << 14, 1 << 16, 1 << 20):
                assert not prefers(mode, num_tokens, capturing), (mode, num_tokens, capturing)
    # Casts: native below 16384 tokens, Triton from there on, captured or not.
    for capturing in (False, True):
        for num_tokens in (None, 1, (1 << 14) - 1):
            assert not prefers(KVQuantMode.NONE, num_tokens, capturing), (num_tokens, capturing)
        assert prefers(KVQuantMode.NONE, 1 << 14, capturing) and prefers(KVQuantMode.NONE, 1 << 20, capturing)
    # On CPU native always wins; Triton (interpreted) runs only when forced.
    cpu = Situation("encode_kv", "cpu", KVQuantMode.NVFP4, "any", False)
    assert impls["native"].rank(cpu) < impls["reference"].rank(cpu) and impls["triton"].rank(cpu) is None


@pytest.mark.gpu
@gpu
def test_cuda_backend_by_token_count(monkeypatch):
    pytest.importorskip("triton")
    if native.unavailable_reason("encode_kv", "cuda", 0) is not None:
        pytest.skip("no CUDA kernels")
    monkeypatch.delenv("KVFUSE_CACHE_WRITE_BACKEND", raising=False)
    monkeypatch.delenv("KVFUSE_BACKEND", raising=False)
    backends.clear_cache()
    try:
        pth = KVQuantMode.FP8_PER_TOKEN_HEAD
        for mode in native.IMPLEMENTATION.modes:
            assert backends.select("encode_and_cache_write", "cuda", mode, 64)[0] == "native"
            bulk = "triton" if mode is KVQuantMode.NONE else "native"
            assert backends.select("encode_and_cache_write", "cuda", mode, 1 << 16)[0] == bulk
        assert backends.select("encode_and_cache_write", "cuda", KVQuantMode.FP8_E4M3, 1 << 14)[0] == "native"
        assert backends.select("encode_and_cache_write", "cuda", KVQuantMode.NONE, 1 << 14)[0] == "triton"
        # Under CUDA-graph capture as outside it: native below the casts' 16384 tokens.
        x = torch.randn(4, 2, 64, device="cuda", dtype=torch.bfloat16)
        scale = torch.ones((), device="cuda")
        calls = {m: (lambda m=m: kv_ops.encode_kv(x, scale, m, storage_dtype(m, x.dtype))) for m in KVQuantMode}
        for call in calls.values():  # warm-up (Triton compiles) outside capture
            call()
        torch.cuda.synchronize()
        chosen, outputs = {}, {}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for mode, call in calls.items():
                chosen[mode] = backends.select("encode_kv", "cuda", mode, 4)[0]
                outputs[mode] = call()
            bulk_nvfp4 = backends.select("encode_and_cache_write", "cuda", KVQuantMode.NVFP4, 1024)[0]
        graph.replay()
        for mode, out in outputs.items():
            _assert_same(out, ref.encode_kv(x, scale, mode, storage_dtype(mode, x.dtype)), f"captured {mode.name}")
        # (encode_kv of per-token-head FP8 has no native kernel: Triton's.)
        assert chosen == {m: "triton" if m is pth else "native" for m in KVQuantMode}
        assert bulk_nvfp4 == "native"
        monkeypatch.setenv("KVFUSE_CACHE_WRITE_BACKEND", "triton")
        backends.clear_cache()
        assert backends.select("encode_and_cache_write", "cuda", KVQuantMode.FP8_E4M3, 64)[0] == "triton"
        monkeypatch.setenv("KVFUSE_CACHE_WRITE_BACKEND", "native")
        backends.clear_cache()
        assert backends.select("encode_and_cache_write", "cuda", KVQuantMode.NONE, 1 << 16)[0] == "native"
    finally:
        backends.clear_cache()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", [KVQuantMode.FP8_E4M3, KVQuantMode.NVFP4, KVQuantMode.FP8_PER_TOKEN_HEAD],
                         ids=lambda m: m.name)
def test_cuda_writes_launched_as_dependents_wait_for_their_producers(mode):
    """The writes are programmatic dependents (csrc/cuda/grid_dependency.h): in a graph where a torch
    kernel computes the key and two writes share slots, each write must see the key of this replay
    (not the last one's) and the second write's rows must win on the shared slots."""
    if native.unavailable_reason("encode_and_cache_write", "cuda", mode) is not None:
        pytest.skip(native.unavailable_reason("encode_and_cache_write", "cuda", mode))
    gen = torch.Generator(device="cuda").manual_seed(7)
    T, H, D, block = 16384, 8, 128, 16
    num_blocks = 2 * T // block
    source = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    value = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    key = torch.zeros_like(source)
    perm = torch.randperm(num_blocks * block, device="cuda", generator=gen)
    slots_a = perm[:T]
    slots_b = torch.cat([perm[: T // 2], perm[T:T + T // 2]])  # no slot twice within a write
    slots_b[1::7] = -1
    k_scale, v_scale = _scales(mode, "cuda")
    cache = _sentinel_cache(num_blocks, block, H, row_dim_for(mode, D), storage_dtype(mode, torch.bfloat16), "cuda")

    def step():
        torch.mul(source, 3, out=key)
        native.encode_and_cache_write(key, value, cache, slots_a, k_scale, v_scale, int(mode))
        native.encode_and_cache_write(value, key, cache, slots_b, k_scale, v_scale, int(mode))

    step()  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(2):
        source.copy_(torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen))
        fresh = _sentinel_cache(num_blocks, block, H, row_dim_for(mode, D), storage_dtype(mode, torch.bfloat16),
                                "cuda")
        cache.copy_(fresh)
        expected = fresh.clone()
        want_key = source * 3
        ref.encode_and_cache_write(want_key, value, expected, slots_a, k_scale, v_scale, mode)
        ref.encode_and_cache_write(value, want_key, expected, slots_b, k_scale, v_scale, mode)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(cache, expected, f"{mode.name}, replay {replay}")


# ----------------------------------------------------------------------------- eager routing (CUDA)


def _fused_case(num_tokens, mode=KVQuantMode.FP8_E4M3, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    key = torch.randn(num_tokens, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    value = torch.randn(num_tokens, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    num_blocks = max(4, -(-2 * num_tokens // 16))
    slots = torch.randperm(num_blocks * 16, device="cuda", generator=gen)[:num_tokens]
    slots[::5] = -1
    scale = torch.tensor(0.25, device="cuda")
    cache = sentinel_cache((num_blocks, 2, 16, 8, row_dim_for(mode, 128)), storage_dtype(mode, torch.bfloat16),
                           device="cuda")
    return key, value, cache, slots, scale


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", list(KVQuantMode), ids=lambda m: m.name)
def test_cuda_routing_runs_the_kernel_from_the_dispatcher(mode):
    """After the first CUDA call the C++ router runs small fused writes; results stay the reference's
    bits for small and bulk writes (bulk goes on to the Python body and Triton)."""
    if native.unavailable_reason("encode_kv", "cuda", 0) is not None:
        pytest.skip("no CUDA kernels")
    backends.clear_cache()
    for num_tokens in (7, 533, 65536 + 3):
        key, value, cache, slots, scale = _fused_case(num_tokens, mode)
        expected = cache.cpu().clone()
        ref.encode_and_cache_write(key.cpu(), value.cpu(), expected, slots.cpu(), scale.cpu(), scale.cpu(), mode)
        torch.ops.kvfuse.encode_and_cache_write(key, value, cache, slots, scale, scale, int(mode), "layers.0")
        _assert_same(cache.cpu(), expected, f"routed {mode.name} T={num_tokens}")
        assert native.cuda_routing_active()


@pytest.mark.gpu
@gpu
def test_cuda_routing_hands_nvfp4_cache_not_contiguous_within_a_page_to_python():
    """The router's pre-check (fits_encode_and_write) sends the call to the Python body, whose
    validator refuses it; the native op is never entered with it (a throw there is not how
    refusals reach Python on CUDA)."""
    if native.unavailable_reason("encode_kv", "cuda", 0) is not None:
        pytest.skip("no CUDA kernels")
    backends.clear_cache()
    op = torch.ops.kvfuse.encode_and_cache_write
    key, value, cache, slots, scale = _fused_case(9, KVQuantMode.NVFP4)
    op(key, value, cache, slots, scale, scale, int(KVQuantMode.NVFP4), "layers.0")
    assert native.cuda_routing_active()
    key, value, buf, sliced, slots, k_scale, v_scale = _paged_nvfp4_refusal_case("cuda")
    before = buf.clone()
    with pytest.raises(ValueError, match=r"encode_and_cache_write.*not contiguous within a page.*allocate_kv_cache"):
        op(key, value, sliced, slots, k_scale, v_scale, int(KVQuantMode.NVFP4), "layers.0")
    torch.cuda.synchronize()
    assert torch.equal(buf, before)


@pytest.mark.gpu
@gpu
def test_cuda_routing_refusals_checked_mode_and_forced_backend(monkeypatch):
    if native.unavailable_reason("encode_kv", "cuda", 0) is not None:
        pytest.skip("no CUDA kernels")
    from kvfuse.ops import checks

    backends.clear_cache()
    key, value, cache, slots, scale = _fused_case(9)
    op = torch.ops.kvfuse.encode_and_cache_write
    op(key, value, cache, slots, scale, scale, 1, "layers.0")
    assert native.cuda_routing_active()
    # A refused call: the Python validator's message, and the cache untouched.
    before = cache.clone()
    with pytest.raises(ValueError, match=r"kv_cache.dtype=torch.float8_e4m3fn cannot hold kv_quant_mode=NVFP4"):
        op(key, value, cache, slots, scale, scale, 3, "layers.0")
    with pytest.raises(ValueError, match=r"slot_mapping has 8 entries but there are 9 tokens"):
        op(key, value, cache, slots[:8], scale, scale, 1, "layers.0")
    _assert_same(cache, before, "refused calls wrote nothing")
    # Checked mode: every call goes to the Python body, where the data checks run.
    dup = slots.clone()
    dup[1] = dup[2] = 3
    with checks.checked():
        with pytest.raises(ValueError, match="checked mode"):
            op(key, value, cache, dup, scale, scale, 1, "layers.0")
        assert not native.cuda_routing_active()
    op(key, value, cache, slots, scale, scale, 1, "layers.0")
    assert native.cuda_routing_active()
    # A forced backend other than native: no routing, and that backend runs.
    monkeypatch.setenv("KVFUSE_CACHE_WRITE_BACKEND", "triton")
    backends.clear_cache()
    try:
        key, value, cache, slots, scale = _fused_case(9, seed=1)
        expected = cache.cpu().clone()
        ref.encode_and_cache_write(key.cpu(), value.cpu(), expected, slots.cpu(), scale.cpu(), scale.cpu(), 1)
        op(key, value, cache, slots, scale, scale, 1, "layers.0")
        assert not native.cuda_routing_active()
        _assert_same(cache.cpu(), expected, "forced triton")
    finally:
        monkeypatch.delenv("KVFUSE_CACHE_WRITE_BACKEND")
        backends.clear_cache()


@pytest.mark.gpu
@gpu
def test_cuda_routing_with_native_forced_leaves_the_format_it_lacks_to_a_loud_refusal(monkeypatch):
    """Forced native: the router installs for every format csrc/ writes (bits equal to the
    reference); per-token-head writes, which the router leaves to the Python body, run their own
    kernel there, and a layout that kernel does not take is refused naming the argument instead of
    breaking the router's installation for all formats."""
    if native.unavailable_reason("encode_kv", "cuda", 0) is not None:
        pytest.skip("no CUDA kernels")
    monkeypatch.setenv("KVFUSE_CACHE_WRITE_BACKEND", "native")
    backends.clear_cache()
    op = torch.ops.kvfuse.encode_and_cache_write
    try:
        for mode in native.IMPLEMENTATION.modes:
            key, value, cache, slots, scale = _fused_case(533, mode, seed=4)
            expected = cache.cpu().clone()
            ref.encode_and_cache_write(key.cpu(), value.cpu(), expected, slots.cpu(), scale.cpu(), scale.cpu(), mode)
            op(key, value, cache, slots, scale, scale, int(mode), "layers.0")
            _assert_same(cache.cpu(), expected, f"forced native {mode.name}")
            assert native.cuda_routing_active()
        pth = KVQuantMode.FP8_PER_TOKEN_HEAD
        key, value, cache, slots, scale = _fused_case(9, pth, seed=5)
        key, value = key[..., :68], value[..., :68]  # head_size 68: not a multiple of 8
        cache = cache[..., :72].contiguous()
        before = cache.clone()
        with pytest.raises(ValueError, match="native FP8_PER_TOKEN_HEAD write cannot run this call: head_size=68"):
            op(key, value, cache, slots, scale, scale, int(pth), "layers.0")
        torch.cuda.synchronize()
        assert torch.equal(cache, before)
        assert native.cuda_routing_active()
    finally:
        monkeypatch.delenv("KVFUSE_CACHE_WRITE_BACKEND")
        backends.clear_cache()


def _prefill_call(mode=KVQuantMode.NONE, tokens=64, seqs=2, head_size=128, q_dtype=torch.bfloat16, step_kv=True,
                  **fields):
    from kvfuse.ops.registry import AttentionCall

    cache = torch.zeros(8, 2, 16, 2, row_dim_for(mode, head_size), dtype=storage_dtype(mode, q_dtype))
    query = torch.zeros(tokens, 4, head_size, dtype=q_dtype)
    kv = torch.zeros(tokens, 2, head_size, dtype=q_dtype) if step_kv else None
    return AttentionCall(query, cache, torch.tensor(1.0), torch.tensor(1.0), torch.zeros(seqs, 4, dtype=torch.int32),
                         torch.full((seqs,), tokens // seqs, dtype=torch.int32),
                         torch.arange(seqs + 1, dtype=torch.int32) * (tokens // seqs), mode, 0.1,
                         fields.pop("sliding_window", None), key=kv, value=kv if kv is None else kv.clone(), **fields)


@pytest.mark.parametrize("fields,expected", [
    (dict(mode=KVQuantMode.FP8_PER_TOKEN_HEAD), "kv_quant_mode=FP8_PER_TOKEN_HEAD"),
    (dict(q_dtype=torch.float32), "query dtype torch.float32"),
    (dict(head_size=64), "head_size=64"),
    (dict(tokens=8, seqs=2), "decode-shaped"),
    (dict(sliding_window=32), "sliding_window=32"),
    (dict(logit_softcap=30.0), "logit_softcap=30.0"),
    (dict(step_kv=False), "without the step's key / value"),
    ({}, "query is on cpu"),
    (dict(mode=KVQuantMode.NVFP4, step_kv=False), "query is on cpu"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_prefill_refusals_name_the_reason(fields, expected):
    """What the native prefill kernel does not take, each named (a CPU host gets as far as the device)."""
    reason = native.prefill_refusal(_prefill_call(**fields))
    assert reason is not None and expected in reason


def test_prefill_refuses_mixed_formats_and_unaligned_rows():
    from kvfuse.kv_cache import KVFormat

    mixed = KVFormat(KVQuantMode.NONE, KVQuantMode.FP8_E4M3)
    call = _prefill_call()
    assert f"kv_quant_mode={mixed.name}" in native.prefill_refusal(dataclasses.replace(call, kv_quant_mode=mixed))
    head_major = call.query.transpose(0, 1).contiguous().transpose(0, 1)
    assert "query strides" in native.prefill_refusal(dataclasses.replace(call, query=head_major))
    odd_key = torch.zeros(64, 2, 129, dtype=torch.bfloat16)[:, :, :128]
    assert "key" in native.prefill_refusal(dataclasses.replace(call, key=odd_key))


def test_prefill_leaves_exact_value_fp8_prefill_to_triton(monkeypatch):
    """KVFUSE_FP8_PREFILL_DOTS=0 asks for e4m3 prefill in the model dtype: the native kernel (FP8
    products only) declines it; e5m2 and NVFP4 are unaffected."""
    from kvfuse import envs

    monkeypatch.setenv("KVFUSE_FP8_PREFILL_DOTS", "0")
    envs.reload()
    reason = native.prefill_refusal(_prefill_call(mode=KVQuantMode.FP8_E4M3, step_kv=False))
    assert "KVFUSE_FP8_PREFILL_DOTS=0" in reason
    assert "query is on cpu" in native.prefill_refusal(_prefill_call(mode=KVQuantMode.FP8_E5M2, step_kv=False))
    monkeypatch.delenv("KVFUSE_FP8_PREFILL_DOTS")
    envs.reload()
    assert "query is on cpu" in native.prefill_refusal(_prefill_call(mode=KVQuantMode.FP8_E4M3, step_kv=False))
