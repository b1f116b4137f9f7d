"""The two rotations of the fused RoPE + write kernel (``rotation="split"`` / ``"gather"``).

Both must give the reference's bytes: the cache (every format) and the returned query, over
NeoX and GPT-J, full and partial rotary, full- and half-width tables, head sizes 64/80/128 and
odd token counts. The split form is only defined where NeoX halves fill the tile; elsewhere the
launcher must refuse ``"split"`` by name and choose the gathered form by default.
"""

from __future__ import annotations

import pytest
import torch

from kvfuse.kv_cache import KVQuantMode
from kvfuse.ops import reference
from kvfuse.ops.triton import rope_kv_write

from _cache_formats import FORMATS, FORMAT_IDS
from test_rope_kv_write import _bytes_equal, _call, _case, _clone

ALL_FORMATS = FORMATS + [(KVQuantMode.FP8_PER_TOKEN_HEAD, torch.uint8)]
ALL_FORMAT_IDS = FORMAT_IDS + ["e4m3-per-token-head"]

# (head_size, rotary_dim, half-width table, position-indexed table, tokens)
SHAPES = [(64, 64, False, False, 7), (128, 128, True, True, 7), (80, 80, True, False, 7),
          (128, 64, False, True, 7), (64, 32, True, False, 33)]
SHAPE_IDS = ["d64", "d128-half-table", "d80", "d128-partial", "d64-partial-33tok"]


def _triton_vs_reference(c, is_neox, mode, rotation):
    """The whole cache (written rows, and the sentinel bytes of every other slot) and the
    returned query, byte for byte against the reference."""
    ref = _clone(c)
    want_q = _call(reference.rope_encode_and_cache_write, ref, is_neox, mode)
    got_q = _call(rope_kv_write.rope_encode_and_cache_write, c, is_neox, mode, rotation=rotation)
    _bytes_equal(c["kv_cache"], ref["kv_cache"], "cache")
    if c["query"] is None:
        assert got_q.numel() == 0
    else:
        _bytes_equal(got_q, want_q, "query")
        assert got_q.is_contiguous()


def _block_d(mode, head_size):
    """The tile width the launcher gives this format (NVFP4: 16 times a power of two blocks)."""
    if mode is KVQuantMode.NVFP4:
        return 16 * (1 << (head_size // 16 - 1).bit_length())
    return 1 << (head_size - 1).bit_length()


@pytest.mark.parametrize("rotation", ["split", "gather"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("d,rotary_dim,half,table,T", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("mode,cache_dtype", ALL_FORMATS, ids=ALL_FORMAT_IDS)
def test_rotation_matches_reference(mode, cache_dtype, d, rotary_dim, half, table, T, is_neox, rotation):
    if rotation == "split" and not rope_kv_write.split_rotation_applies(is_neox, rotary_dim, _block_d(mode, d),
                                                                        torch.bfloat16):
        pytest.skip("NeoX halves do not fill the tile: the split form does not apply (see test_split_refused)")
    c = _case(T, 3, 2, d, mode, cache_dtype, rotary_dim=rotary_dim, half=half, table=table,
              seed=d * 31 + rotary_dim + int(mode) * 7 + is_neox)
    _triton_vs_reference(c, is_neox, mode, rotation=rotation)


@pytest.mark.parametrize("in_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_split_key_dtypes(in_dtype, is_neox):
    """The split form rounds K to its own dtype before encoding, as the gathered one does."""
    c = _case(5, 2, 2, 64, KVQuantMode.FP8_E4M3, torch.float8_e4m3fn, in_dtype=in_dtype, seed=13)
    _triton_vs_reference(c, is_neox, KVQuantMode.FP8_E4M3, rotation="split")


def test_split_without_query():
    c = _case(7, 1, 2, 128, KVQuantMode.NVFP4, torch.uint8, half=True, seed=17)
    c["query"] = None
    _triton_vs_reference(c, True, KVQuantMode.NVFP4, rotation="split")


@pytest.mark.parametrize("is_neox,rotary_dim,d,mode,in_dtype", [
    (True, 64, 128, KVQuantMode.NONE, torch.bfloat16),    # partial rotary: the halves are not the tile's
    (True, 80, 80, KVQuantMode.FP8_E4M3, torch.bfloat16),  # head size 80 in a 128-wide tile
    (True, 80, 80, KVQuantMode.NVFP4, torch.bfloat16),
    (False, 64, 64, KVQuantMode.NONE, torch.float32),     # float32 rows (see split_rotation_applies)
])
def test_split_refused_where_it_does_not_apply(is_neox, rotary_dim, d, mode, in_dtype):
    cache_dtype = dict(ALL_FORMATS)[mode]
    c = _case(3, 2, 1, d, mode, cache_dtype, rotary_dim=rotary_dim, in_dtype=in_dtype)
    before = c["kv_cache"].clone()
    style = "NeoX" if is_neox else "GPT-J"
    with pytest.raises(ValueError, match=rf"rotation='split' does not apply to {style} rotary_dim={rotary_dim} "
                                         rf"of {in_dtype} rows"):
        _call(rope_kv_write.rope_encode_and_cache_write, c, is_neox, mode, rotation="split")
    assert torch.equal(c["kv_cache"].view(torch.uint8), before.view(torch.uint8))


def test_unknown_rotation_refused():
    c = _case(3, 2, 1, 64, KVQuantMode.NONE, torch.bfloat16)
    with pytest.raises(ValueError, match=r"rotation='rotate'; allowed: 'split', 'gather' or None"):
        _call(rope_kv_write.rope_encode_and_cache_write, c, True, KVQuantMode.NONE, rotation="rotate")


class _Recorder:
    """Stands in for the kernel: records the SPLIT constexpr of each launch."""

    def __init__(self):
        self.split = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.split.append(kwargs["SPLIT"])
        return launch


@pytest.mark.parametrize("is_neox,rotary_dim,d,in_dtype,want", [
    (True, 128, 128, torch.bfloat16, True), (False, 128, 128, torch.float16, True),
    (False, 40, 80, torch.bfloat16, True), (True, 64, 128, torch.bfloat16, False),
    (True, 80, 80, torch.bfloat16, False), (True, 128, 128, torch.float32, False),
    (False, 128, 128, torch.float32, False)])
def test_default_is_split_where_it_applies(monkeypatch, is_neox, rotary_dim, d, in_dtype, want):
    # A bf16 cache: the measured policy never asks for the gathered form there (for FP8 and
    # NVFP4 it does below 256 tokens: test_default_rotation_follows_the_measured_policy).
    recorder = _Recorder()
    monkeypatch.setattr(rope_kv_write, "_rope_encode_and_cache_write_kernel", recorder)
    c = _case(3, 2, 1, d, KVQuantMode.NONE, torch.bfloat16, rotary_dim=rotary_dim, in_dtype=in_dtype)
    _call(rope_kv_write.rope_encode_and_cache_write, c, is_neox, KVQuantMode.NONE)
    assert recorder.split == [want]


def test_small_fp8_writes_launch_the_gathered_rotation(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(rope_kv_write, "_rope_encode_and_cache_write_kernel", recorder)
    for tokens in (3, 300):
        c = _case(tokens, 2, 1, 128, KVQuantMode.FP8_E4M3, torch.float8_e4m3fn)
        _call(rope_kv_write.rope_encode_and_cache_write, c, True, KVQuantMode.FP8_E4M3)
    assert recorder.split == [False, True]


def test_compile_matrix_names_both_rotations():
    """tests/ops/_triton_compile.py compiles, for sm_90, the split form of each path that stores it
    differently (NeoX halves stored apart: casts and FP8; joined: per-token-head and NVFP4; GPT-J)
    and the gathered form of both styles, full-width rows included (the benchmark's gather row)."""
    import _triton_compile as tc

    seen = set()
    for case in tc.CASES:
        if case.kernel != "rope":
            continue
        p = case.params
        mode = KVQuantMode[p["mode"]]
        applies = rope_kv_write.split_rotation_applies(p["neox"], p["rotary"], _block_d(mode, p["head"]),
                                                       getattr(torch, p["in_dtype"]))
        split = applies if p.get("rotation") is None else p["rotation"] == "split"
        seen.add((p["neox"], split, mode, p["rotary"] == p["head"]))
    want = {(True, True, KVQuantMode.NONE), (True, True, KVQuantMode.FP8_E4M3),
            (True, True, KVQuantMode.FP8_PER_TOKEN_HEAD), (True, True, KVQuantMode.NVFP4),
            (False, True, KVQuantMode.NVFP4), (False, True, KVQuantMode.NONE)}
    assert want <= {(neox, split, mode) for neox, split, mode, _ in seen}
    for neox in (True, False):
        assert any(n == neox and not s and full for n, s, _, full in seen), f"neox={neox}: no full-width gather"


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf * 0
@pytest.mark.parametrize("rotation", ["split", "gather"])
@pytest.mark.parametrize("is_neox,d,rotary_dim", [(True, 64, 64), (False, 64, 64), (False, 128, 64),
                                                  (True, 128, 64)], ids=["neox", "gptj", "gptj-partial",
                                                                         "neox-partial"])
@pytest.mark.parametrize("mode,cache_dtype", [ALL_FORMATS[0], ALL_FORMATS[3], ALL_FORMATS[5]],
                         ids=["bf16", "e4m3", "nvfp4"])
def test_rotation_special_values(mode, cache_dtype, is_neox, d, rotary_dim, rotation):
    """Signed zeros in the rotated features, and infinities, NaN and -0 past ``rotary_dim``: those
    are passed through exactly (not as ``x * 1 + partner * 0``, which makes NaN of an infinite
    partner and +0 of -0). (Infinities among the rotated features give NaN whose bits the
    reference's CPU arithmetic and the kernel need not share, so they are left out there.)"""
    if rotation == "split" and not rope_kv_write.split_rotation_applies(is_neox, rotary_dim, _block_d(mode, d),
                                                                        torch.bfloat16):
        pytest.skip("the split form does not apply")
    c = _case(7, 2, 2, d, mode, cache_dtype, rotary_dim=rotary_dim, seed=23)
    rotated = torch.tensor([0.0, -0.0])
    passed = torch.tensor([-0.0, float("inf"), -float("inf"), float("nan")])
    for name in ("query", "key"):
        x = c[name]
        g = torch.Generator().manual_seed(5 + len(name))
        for features, values in ((slice(0, rotary_dim), rotated), (slice(rotary_dim, d), passed)):
            part = x[..., features]
            picks = values[torch.randint(0, values.numel(), part.shape, generator=g)].to(x.dtype)
            chosen = torch.rand(part.shape, generator=g) < 0.3
            part[chosen] = picks[chosen]
    _triton_vs_reference(c, is_neox, mode, rotation)


def test_default_rotation_follows_the_measured_policy():
    """rotation=None: where the split form applies, the policy's choice by format and token count
    (sm90's table on the CPU interpreter: gathered below 256 tokens for FP8 and NVFP4); where it
    does not apply, gather whatever the size."""
    from kvfuse.ops import tuning

    policy = tuning.rope_write_policy(torch.device("cpu"))
    assert policy is tuning.ROPE_WRITE_POLICIES["sm90"]
    cpu = torch.device("cpu")
    choose = rope_kv_write._split_rotation
    for mode in (KVQuantMode.FP8_E4M3, KVQuantMode.NVFP4):
        limit = policy.gather_below[mode]
        assert not choose(None, True, 128, 128, torch.bfloat16, int(mode), limit - 1, cpu)
        assert choose(None, True, 128, 128, torch.bfloat16, int(mode), limit, cpu)
        assert choose("split", True, 128, 128, torch.bfloat16, int(mode), 1, cpu)  # forced
    assert choose(None, True, 128, 128, torch.bfloat16, int(KVQuantMode.NONE), 1, cpu)
    assert not choose(None, True, 128, 128, torch.float32, int(KVQuantMode.NONE), 1 << 20, cpu)
    assert not choose(None, True, 64, 128, torch.bfloat16, int(KVQuantMode.FP8_E4M3), 1 << 20, cpu)


def test_rope_write_policy_is_validated():
    from kvfuse.ops import tuning

    with pytest.raises(ValueError, match="gather_below=.*positive token counts"):
        tuning.RopeWritePolicy(gather_below={KVQuantMode.NVFP4: 0})
    assert tuning.RopeWritePolicy(gather_below={}).rotation(KVQuantMode.NVFP4, 1) == "split"
