"""``kvfuse::rope_encode_and_cache_write``: reference definition, Triton kernel, op validation, opcheck.

The reference is held to its definition ("rotate, then encode_and_cache_write") written out
independently here; the Triton kernel (interpreted on CPU) is held to the reference byte for
byte, over every cache format, both rotary styles, partial rotary, half- and full-width cos/sin
tables, per-token rows and position-indexed tables, padding slots and poisoned caches.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from kvfuse.kv_cache import KVQuantMode, logical_cache_rows, row_dim_for
from kvfuse.ops import reference
from kvfuse.ops import registry

from _cache_formats import FORMATS, FORMAT_IDS, SENTINEL, sentinel_cache

OP = torch.ops.kvfuse.rope_encode_and_cache_write
BLOCK = 4


def _tables(num_rows, rotary_dim, half, dtype, g, device="cpu"):
    width = rotary_dim // 2 if half else rotary_dim
    angles = torch.rand(num_rows, width, generator=g) * 6.0
    return angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)


def _case(T, hq, h, d, mode, cache_dtype, *, in_dtype=torch.bfloat16, rotary_dim=None, half=False, table=False,
          seed=0, device="cpu", num_blocks=None, block=BLOCK):
    g = torch.Generator().manual_seed(seed)
    rotary_dim = rotary_dim or d
    q = (torch.randn(T, hq, d, generator=g) * 3).to(in_dtype).to(device)
    # K and V as strided views of one projection output, as a model hands them over.
    kv = (torch.randn(T, 2 * h * d + 8, generator=g) * 3).to(in_dtype).to(device)
    key = kv[:, : h * d].view(T, h, d)
    value = kv[:, h * d: 2 * h * d].view(T, h, d)
    num_blocks = num_blocks or (T + block - 1) // block + 2
    cache = sentinel_cache((num_blocks, 2, block, h, row_dim_for(mode, d)), cache_dtype, device)
    slots = torch.randperm(num_blocks * block, generator=g)[:T].to(device)
    slots[T // 3] = -1
    if table:
        cos, sin = _tables(T + 5, rotary_dim, half, in_dtype, g, device)
        positions = torch.randint(0, T + 5, (T,), generator=g).to(device)
    else:
        cos, sin = _tables(T, rotary_dim, half, in_dtype, g, device)
        positions = None
    scale = torch.tensor(0.75 if mode is not KVQuantMode.NVFP4 else 0.5, device=device)
    return dict(query=q, key=key, value=value, kv_cache=cache, slot_mapping=slots, k_scale=scale,
                v_scale=scale * 2, cos=cos, sin=sin, positions=positions, rotary_dim=rotary_dim)


def _call(impl, c, is_neox, mode, **kw):
    return impl(c["query"], c["key"], c["value"], c["kv_cache"], c["slot_mapping"], c["k_scale"], c["v_scale"],
                c["cos"], c["sin"], c["positions"], c["rotary_dim"], is_neox, int(mode), **kw)


def _clone(c):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in c.items()}


def _bytes_equal(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    diff = (a.view(torch.uint8) != b.view(torch.uint8)).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} bytes differ, first at {diff[:4].tolist()}"


# ----------------------------------------------------------------------------- the reference's definition


def _rotate_by_definition(x, cos, sin, positions, rotary_dim, is_neox):
    """The rotation written element by element from its definition (an independent oracle)."""
    T, H, D = x.shape
    R = rotary_dim
    out = x.float().clone()
    xf = x.float()
    for t in range(T):
        row = int(positions[t]) if positions is not None else t
        for i in range(R):
            if is_neox:
                p, sign = (i + R // 2, -1.0) if i < R // 2 else (i - R // 2, 1.0)
                col = i if cos.shape[1] == R else i % (R // 2)
            else:
                p, sign = (i + 1, -1.0) if i % 2 == 0 else (i - 1, 1.0)
                col = i if cos.shape[1] == R else i // 2
            c = cos[row, col].float()
            s = sin[row, col].float()
            out[t, :, i] = xf[t, :, i] * c + (sign * xf[t, :, p]) * s
    return out.to(x.dtype)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("half,table,rotary_dim", [(False, False, None), (True, True, None), (False, True, 16),
                                                   (True, False, 8)], ids=["full", "half-table", "partial", "half-partial"])
def test_reference_rotation_is_its_definition(is_neox, half, table, rotary_dim):
    c = _case(5, 2, 2, 32, KVQuantMode.NONE, torch.bfloat16, rotary_dim=rotary_dim, half=half, table=table, seed=3)
    got = reference.apply_rope(c["key"], c["cos"], c["sin"], c["positions"], c["rotary_dim"], is_neox)
    want = _rotate_by_definition(c["key"], c["cos"], c["sin"], c["positions"], c["rotary_dim"], is_neox)
    _bytes_equal(got, want, "rotation")
    # features past rotary_dim are untouched
    _bytes_equal(got[..., c["rotary_dim"]:], c["key"][..., c["rotary_dim"]:], "pass-through")


@pytest.mark.parametrize("mode,cache_dtype", FORMATS, ids=FORMAT_IDS)
def test_reference_is_rotate_then_write(mode, cache_dtype):
    c = _case(9, 4, 2, 32, mode, cache_dtype, half=True, seed=4)
    want = _clone(c)
    k_rot = _rotate_by_definition(c["key"], c["cos"], c["sin"], None, 32, True)
    reference.encode_and_cache_write(k_rot, c["value"], want["kv_cache"], c["slot_mapping"], c["k_scale"],
                                     c["v_scale"], int(mode))
    q = _call(reference.rope_encode_and_cache_write, c, True, mode)
    _bytes_equal(c["kv_cache"], want["kv_cache"], "cache")
    _bytes_equal(q, _rotate_by_definition(c["query"], c["cos"], c["sin"], None, 32, True), "query")


def test_fma_f32_rounds_once():
    """The contracted reference's fma: one rounding of the exact a * b + c, also where rounding the
    float64 sum first would land on a float32 tie (1 + 2^-23 + 2^-24 - 2^-70 here), and against
    exact rational arithmetic on random cancellation-heavy inputs."""
    from fractions import Fraction

    a = torch.tensor([2.0**-24 * (1 + 2.0**-23)])
    b = torch.tensor([1 - 2.0**-23])
    c = torch.tensor([1 + 2.0**-23])
    assert reference.fma_f32(a, b, c).item() == 1 + 2.0**-23
    assert (a.double() * b.double() + c.double()).float().item() == 1 + 2.0**-22  # rounded twice
    assert reference.fma_f32(-a, b, -c).item() == -(1 + 2.0**-23)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(300, generator=g) * torch.exp2(torch.randint(-20, 20, (300,), generator=g).float())
    b = torch.randn(300, generator=g)
    c = -(a * b) * (1 + torch.randn(300, generator=g) * 2.0**-18)
    got = reference.fma_f32(a, b, c)
    for x, y, z, r in zip(a.tolist(), b.tolist(), c.tolist(), got.tolist()):
        exact = Fraction(x) * Fraction(y) + Fraction(z)
        # no nearer float32 on the exact value's side of r
        other = torch.nextafter(torch.tensor(r), torch.tensor(math.inf if exact > r else -math.inf)).item()
        assert abs(Fraction(r) - exact) <= abs(Fraction(other) - exact), (x, y, z, r)


def test_contracted_rotation_differs_only_where_products_round():
    """bf16 tables: x * cos is exact in float32, so both forms agree; float32 tables: they differ
    (seen in a float32 result; a bf16 one rounds most of the last-bit differences away)."""
    c = _case(64, 4, 2, 32, KVQuantMode.NONE, torch.bfloat16, seed=3)
    args = (c["key"].float(), c["cos"], c["sin"], None, 32, True)
    assert torch.equal(reference.apply_rope(*args), reference.apply_rope(*args, contract=True))
    f32 = (c["key"].float(), c["cos"].float() * 1.0001, c["sin"].float() * 0.9999, None, 32, True)
    differ = reference.apply_rope(*f32) != reference.apply_rope(*f32, contract=True)
    assert 0 < differ.sum() < differ.numel() // 4


# ----------------------------------------------------------------------------- Triton vs reference


def _triton_vs_reference(c, is_neox, mode, device="cpu", contract=False, **kw):
    from kvfuse.ops.triton import rope_kv_write

    ref = _clone(c)
    want_q = _call(reference.rope_encode_and_cache_write, ref, is_neox, mode, contract=contract)
    got_q = _call(rope_kv_write.rope_encode_and_cache_write, c, is_neox, mode, **kw)
    _bytes_equal(c["kv_cache"].cpu(), ref["kv_cache"].cpu(), "cache")
    if c["query"] is None:
        assert got_q.numel() == 0
    else:
        _bytes_equal(got_q.cpu(), want_q.cpu(), "query")
        assert got_q.is_contiguous()
    # padding slots and slots nobody wrote keep the sentinel in every byte of their logical rows
    # (an NVFP4 row's bytes are spread over its page)
    written = set(int(s) for s in c["slot_mapping"].cpu() if s >= 0)
    rows = logical_cache_rows(c["kv_cache"]).cpu().view(torch.uint8)
    block = rows.shape[2]
    unwritten = [slot for slot in range(rows.shape[0] * block) if slot not in written]
    assert unwritten, "the case leaves no slot unwritten"
    for slot in unwritten:
        b, o = divmod(slot, block)
        assert bool((rows[b, :, o] == SENTINEL).all()), f"slot {slot} was written"


@pytest.mark.parametrize("mode,cache_dtype", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_triton_every_format(mode, cache_dtype, is_neox):
    _triton_vs_reference(_case(7, 4, 2, 32, mode, cache_dtype, seed=int(mode) * 7 + is_neox), is_neox, mode)


@pytest.mark.parametrize("T,hq,h,d,rotary_dim,half,table,in_dtype,is_neox", [
    (7, 3, 1, 80, 80, True, False, torch.bfloat16, True),      # odd heads, D=80, demo-style half table
    (5, 2, 2, 64, 32, False, True, torch.float16, False),      # partial rotary, position-indexed table, fp16
    (3, 2, 1, 128, 64, True, True, torch.float32, True),       # D=128, half rotary, fp32 input
    (2, 1, 1, 256, 256, False, False, torch.bfloat16, False),  # D=256 (Gemma)
], ids=["d80-odd-heads", "d64-partial-table-fp16", "d128-fp32", "d256"])
@pytest.mark.parametrize("mode,cache_dtype", [FORMATS[0], FORMATS[3], FORMATS[5]], ids=["bf16", "e4m3", "nvfp4"])
def test_triton_shapes(T, hq, h, d, rotary_dim, half, table, in_dtype, is_neox, mode, cache_dtype):
    c = _case(T, hq, h, d, mode, cache_dtype, in_dtype=in_dtype, rotary_dim=rotary_dim, half=half, table=table,
              seed=T * d)
    _triton_vs_reference(c, is_neox, mode)


@pytest.mark.parametrize("block", [16, 4, 5], ids=lambda b: f"page{b}")
@pytest.mark.parametrize("d,rotary_dim,h,is_neox", [(64, 64, 2, True), (80, 40, 3, False), (128, 128, 1, True)],
                         ids=["d64", "d80-partial", "d128"])
def test_triton_nvfp4_pages(block, d, rotary_dim, h, is_neox):
    """NVFP4 K (rotated) and V rows land in the page layout as the reference places them: V
    scales interleaved at pages of 4 and 16 for d64/d128, linear otherwise."""
    c = _case(9, 2, h, d, KVQuantMode.NVFP4, torch.uint8, rotary_dim=rotary_dim, half=block == 5, table=block == 4,
              seed=block * d, block=block)
    _triton_vs_reference(c, is_neox, KVQuantMode.NVFP4)


def test_triton_533_tokens_without_query():
    c = _case(533, 1, 1, 16, KVQuantMode.FP8_E4M3, torch.float8_e4m3fn, half=True, seed=11)
    c["query"] = None
    _triton_vs_reference(c, True, KVQuantMode.FP8_E4M3)


def test_triton_zero_tokens():
    from kvfuse.ops.triton import rope_kv_write

    c = _case(1, 2, 2, 32, KVQuantMode.NONE, torch.bfloat16)
    c = {k: (v[:0] if k in ("query", "key", "value", "slot_mapping", "cos", "sin") else v) for k, v in c.items()}
    before = c["kv_cache"].clone()
    q = _call(rope_kv_write.rope_encode_and_cache_write, c, True, KVQuantMode.NONE)
    assert q.shape == (0, 2, 32)
    _bytes_equal(c["kv_cache"], before, "cache")


def test_rounding_to_model_dtype_happens_before_encoding():
    """K is rounded to its dtype after the rotation (as the unfused graph stores it), then encoded:
    an fp16 cache of a bf16 key holds bf16-rounded values, not the float32 rotation."""
    c = _case(6, 1, 2, 32, KVQuantMode.NONE, torch.float16, seed=5)
    ref = _clone(c)
    _call(reference.rope_encode_and_cache_write, ref, True, KVQuantMode.NONE)
    k_rot = reference.apply_rope(c["key"], c["cos"], c["sin"], None, 32, True)
    slots = c["slot_mapping"]
    t = int((slots >= 0).nonzero()[0, 0])
    b, o = divmod(int(slots[t]), BLOCK)
    _bytes_equal(ref["kv_cache"][b, 0, o], k_rot[t].to(torch.float16), "key row")
    _triton_vs_reference(c, True, KVQuantMode.NONE)


# ----------------------------------------------------------------------------- the op


def test_op_runs_the_registry_choice(reference_backend):
    c = _case(5, 2, 2, 32, KVQuantMode.FP8_E5M2, torch.float8_e5m2, table=True, seed=2)
    ref = _clone(c)
    want_q = _call(reference.rope_encode_and_cache_write, ref, False, KVQuantMode.FP8_E5M2)
    got_q = OP(c["query"], c["key"], c["value"], c["kv_cache"], c["slot_mapping"], c["k_scale"], c["v_scale"],
               c["cos"], c["sin"], c["positions"], 32, False, int(KVQuantMode.FP8_E5M2), "l0")
    _bytes_equal(got_q, want_q, "query")
    _bytes_equal(c["kv_cache"], ref["kv_cache"], "cache")


def test_op_through_forced_triton(monkeypatch):
    monkeypatch.setenv("KVFUSE_BACKEND", "triton")
    registry.clear_cache()
    try:
        assert registry.select("rope_encode_and_cache_write", "cpu", KVQuantMode.NVFP4).name == "triton"
        c = _case(4, 2, 2, 32, KVQuantMode.NVFP4, torch.uint8, seed=9)
        ref = _clone(c)
        want_q = _call(reference.rope_encode_and_cache_write, ref, True, KVQuantMode.NVFP4)
        got_q = OP(c["query"], c["key"], c["value"], c["kv_cache"], c["slot_mapping"], c["k_scale"], c["v_scale"],
                   c["cos"], c["sin"], None, 32, True, int(KVQuantMode.NVFP4), "l0")
        _bytes_equal(got_q, want_q, "query")
        _bytes_equal(c["kv_cache"], ref["kv_cache"], "cache")
    finally:
        monkeypatch.delenv("KVFUSE_BACKEND")
        registry.clear_cache()


def test_native_claims_the_rotary_write_on_cuda_for_fp8_nvfp4_and_16bit():
    from kvfuse.ops import native

    assert "rope_encode_and_cache_write" in native.IMPLEMENTATION.ops
    for mode in (KVQuantMode.NONE, KVQuantMode.FP8_E4M3, KVQuantMode.NVFP4):
        reason = registry.unavailable_reason("native", "rope_encode_and_cache_write", "cpu", mode)
        assert reason == "its rotary write kernel runs on CUDA, not on cpu"
    reason = registry.unavailable_reason("native", "rope_encode_and_cache_write", "cuda",
                                         KVQuantMode.FP8_PER_TOKEN_HEAD)
    assert reason == ("it implements FP8_PER_TOKEN_HEAD for encode_and_cache_write, paged_attention only, "
                      "not for rope_encode_and_cache_write")
    # On CPU the registry passes over it (Triton is interpreted there: only when forced).
    assert native.IMPLEMENTATION.rank(registry.Situation("rope_encode_and_cache_write", "cpu", KVQuantMode.NVFP4,
                                                         "any", False)) is None


def _native_args(c, is_neox, mode):
    return (c["query"], c["key"], c["value"], c["kv_cache"], c["cos"], c["sin"], c["positions"], c["rotary_dim"],
            is_neox, int(mode))


def _aligned_view(x, offset_elems):
    """``x`` copied into a buffer at ``offset_elems`` elements past a 16-byte boundary."""
    flat = torch.zeros(x.numel() + offset_elems, dtype=x.dtype, device=x.device)
    out = flat[offset_elems:].view(x.shape)
    out.copy_(x)
    return out


@pytest.mark.parametrize("change,reason", [
    (lambda c: dict(kv_quant_mode=int(KVQuantMode.FP8_PER_TOKEN_HEAD)),
     "kv_quant_mode=FP8_PER_TOKEN_HEAD: it writes FP8, NVFP4 and unquantized 16-bit caches"),
    (lambda c: dict(kv_quant_mode=int(KVQuantMode.NONE), kv_cache=torch.zeros(4, 2, 4, 2, 64, dtype=torch.float16)),
     "kv_cache dtype torch.float16: an unquantized cache must hold the key's dtype torch.bfloat16"),
    (lambda c: dict(key=c["key"].float(), value=c["value"].float()), "key dtype torch.float32: it takes bfloat16"),
    (lambda c: dict(rotary_dim=16, is_neox=True), "rotary_dim=16 with NeoX pairs: it takes multiples of 32"),
    (lambda c: dict(rotary_dim=24, is_neox=False), "rotary_dim=24 with GPT-J pairs: it takes multiples of 16"),
    (lambda c: dict(key=_aligned_view(c["key"], 1)), "key/value strides .* rows must start 16-byte aligned"),
    (lambda c: dict(cos=c["cos"].half(), sin=c["sin"].half()), "cos/sin dtype torch.float16: it reads float32"),
    (lambda c: dict(sin=_aligned_view(c["sin"], 2)), r"sin strides \(64, 1\) / address: table rows must start"),
    (lambda c: dict(query=_aligned_view(c["query"], 4)), "query strides .* rows must start 16-byte aligned"),
    (lambda c: dict(kv_cache=_aligned_view(c["kv_cache"].view(torch.uint8), 8).view(torch.float8_e4m3fn)),
     "kv_cache strides .* FP8 and 16-bit rows must start 16-byte aligned"),
    (lambda c: dict(kv_quant_mode=int(KVQuantMode.NONE),
                    kv_cache=_aligned_view(torch.zeros(4, 2, 4, 2, 64, dtype=torch.bfloat16), 4)),
     "kv_cache strides .* FP8 and 16-bit rows must start 16-byte aligned"),
    (lambda c: {}, "key is on cpu: it runs on CUDA"),
], ids=["per-token-head", "fp16-cache-bf16-key", "fp32-key", "neox-16", "gptj-24", "key-unaligned", "fp16-table",
        "sin-unaligned", "query-unaligned", "cache-unaligned", "bf16-cache-unaligned", "cpu"])
def test_native_rotary_refusals_name_the_condition(change, reason):
    from kvfuse.ops import native

    c = _case(5, 4, 2, 64, KVQuantMode.FP8_E4M3, torch.float8_e4m3fn, seed=12)
    args = dict(query=c["query"], key=c["key"], value=c["value"], kv_cache=c["kv_cache"], cos=c["cos"], sin=c["sin"],
                positions=c["positions"], rotary_dim=64, is_neox=True, kv_quant_mode=int(KVQuantMode.FP8_E4M3))
    args.update(change(c))
    got = native.rope_refusal(**args)
    assert got is not None and re.search(reason, got), got


def _bad(c, **changes):
    c = dict(c)
    c.update(changes)
    return c


@pytest.mark.parametrize("change,match", [
    (dict(rotary_dim=3), r"rotary_dim=3 must be an even int in \[2, head_size=32\]"),
    (dict(rotary_dim=34), r"rotary_dim=34 must be an even int"),
    (dict(cos=torch.ones(5, 12), sin=torch.ones(5, 12)), r"cos has width 12; allowed: rotary_dim=32 .* rotary_dim / 2=16"),
    (dict(cos=torch.ones(5, 32, dtype=torch.int32)), r"cos must be 2-D .* got dtype torch.int32"),
    (dict(sin=torch.ones(5, 16)), r"cos \(torch.float32, \(5, 32\)\) and sin \(torch.float32, \(5, 16\)\)"),
    (dict(cos=torch.ones(4, 32), sin=torch.ones(4, 32)), r"cos/sin have 4 rows but there are 5 tokens"),
    (dict(positions=torch.zeros(4, dtype=torch.int64)), r"positions has 4 entries but there are 5 tokens"),
    (dict(positions=torch.zeros(5)), r"positions must be 1-D int32 or int64, got dtype torch.float32"),
    (dict(query=torch.zeros(5, 4, 16, dtype=torch.bfloat16)), r"query .* must have key's dtype torch.bfloat16 and head_size 32"),
    (dict(query=torch.zeros(4, 4, 32, dtype=torch.bfloat16)), r"query has 4 tokens but key has 5"),
    (dict(kv_quant_mode=7), r"kvfuse::rope_encode_and_cache_write .*kv_quant_mode=7 is not one of"),
    (dict(slot_mapping=torch.zeros(4, dtype=torch.int64)), r"slot_mapping has 4 entries but there are 5 tokens"),
])
def test_validation_names_argument_value_and_allowed(change, match):
    c = _case(5, 4, 2, 32, KVQuantMode.NONE, torch.bfloat16, seed=1)
    c["cos"], c["sin"] = c["cos"].float(), c["sin"].float()
    args = dict(c, is_neox=True, kv_quant_mode=int(KVQuantMode.NONE))
    args.update(change)
    before = args["kv_cache"].clone()
    order = ("query", "key", "value", "kv_cache", "slot_mapping", "k_scale", "v_scale", "cos", "sin", "positions",
             "rotary_dim", "is_neox", "kv_quant_mode")
    with pytest.raises(ValueError, match=match):
        OP(*[args[k] for k in order], "layer.7")
    with pytest.raises(ValueError, match="layer 'layer.7'"):
        OP(*[args[k] for k in order], "layer.7")
    _bytes_equal(args["kv_cache"], before, "cache after a refused call")
    # the fake (trace time) gives the same message
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as fm:
        fake = {k: (fm.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        with pytest.raises(ValueError, match=match):
            OP(*[fake[k] for k in order], "layer.7")


def test_checked_mode_refuses_out_of_range_positions(reference_backend):
    from kvfuse.ops.checks import checked

    c = _case(5, 2, 2, 32, KVQuantMode.NONE, torch.bfloat16, table=True)
    c["positions"][2] = c["cos"].shape[0]
    with checked(), pytest.raises(ValueError, match=r"positions\[2\]=10 is out of range; allowed: 0 <= position < 10"):
        OP(*[c[k] for k in ("query", "key", "value", "kv_cache", "slot_mapping", "k_scale", "v_scale", "cos", "sin",
                             "positions", "rotary_dim")], True, 0, "l")


@pytest.mark.parametrize("with_query,table,mode,cache_dtype", [
    (True, False, KVQuantMode.NVFP4, torch.uint8), (False, True, KVQuantMode.NONE, torch.bfloat16)])
def test_opcheck(with_query, table, mode, cache_dtype, reference_backend):
    # (FP8 caches: opcheck's schema test compares with allclose, which has no FP8 CPU kernel.)
    c = _case(5, 4, 2, 32, mode, cache_dtype, half=True, table=table, seed=6)
    args = (c["query"] if with_query else None, c["key"].contiguous(), c["value"].contiguous(), c["kv_cache"],
            c["slot_mapping"], c["k_scale"], c["v_scale"], c["cos"], c["sin"], c["positions"], 32, True,
            int(mode), "l0")
    torch.library.opcheck(OP, args, test_utils="ALL")


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("mode,cache_dtype", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("is_neox,half,table,rotary_dim", [(True, False, False, 128), (False, True, True, 64)])
@pytest.mark.parametrize("T", [1, 64, 533])
def test_gpu_bit_exact_without_contraction(mode, cache_dtype, is_neox, half, table, rotary_dim, T):
    """On the GPU with fp fusion off the kernel is the reference, bit for bit (and with the
    software rounding it takes under the interpreter, too)."""
    c = _case(T, 32, 8, 128, mode, cache_dtype, rotary_dim=rotary_dim, half=half, table=table, seed=T,
              device="cuda", num_blocks=T // BLOCK + 8)
    _triton_vs_reference(_clone(c), is_neox, mode, device="cuda", fp_fusion=False)
    _triton_vs_reference(_clone(c), is_neox, mode, device="cuda", fp_fusion=False, soft_rounding=True)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,cache_dtype", [FORMATS[0], FORMATS[3], FORMATS[5]], ids=["bf16", "e4m3", "nvfp4"])
@pytest.mark.parametrize("is_neox,half,table,table_dtype", [
    (True, False, False, torch.float32), (True, True, False, torch.float32), (False, True, True, torch.float32),
    (True, False, False, torch.bfloat16)], ids=["neox-f32", "neox-f32-half", "gptj-f32-half-pos", "neox-bf16"])
@pytest.mark.parametrize("T", [7, 533])
def test_gpu_triton_contracts_as_the_native_kernel(mode, cache_dtype, is_neox, half, table, table_dtype, T):
    """With fp fusion (Triton's default, and Inductor's) the Triton kernel computes the contracted
    reference, fma(x, cos, rot * sin), bit for bit: the native kernel's form, so the op writes the
    same bytes whichever CUDA kernel runs it (float32 tables are where the forms differ)."""
    c = _case(T, 32, 8, 128, mode, cache_dtype, half=half, table=table, seed=T + int(mode), device="cuda",
              num_blocks=T // BLOCK + 8)
    c["cos"], c["sin"] = c["cos"].to(table_dtype), c["sin"].to(table_dtype)
    _triton_vs_reference(c, is_neox, mode, device="cuda", contract=True)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [16, 5, 32])
@pytest.mark.parametrize("d", [64, 80, 128, 256])
def test_gpu_nvfp4_pages(block, d):
    """NVFP4 pages of every V-scale layout at a realistic token count, bit for bit."""
    c = _case(533, 16, 4, d, KVQuantMode.NVFP4, torch.uint8, half=True, table=True, seed=block + d, device="cuda",
              num_blocks=533 // block + 8, block=block)
    _triton_vs_reference(c, True, KVQuantMode.NVFP4, device="cuda", fp_fusion=False)


def test_native_function_hands_what_it_refuses_to_triton(monkeypatch):
    """A call the policy gives to Triton (NVFP4 with a query) runs Triton's kernel (interpreted
    here), bit for bit the reference; forced onto the native kernel, a call it refuses (on the
    CPU, every call) raises with the refusal's reason."""
    from kvfuse.ops import native

    c = _case(7, 4, 2, 32, KVQuantMode.NVFP4, torch.uint8, half=True, seed=13)
    want_cache, want_q = _reference_result(c, True, KVQuantMode.NVFP4)
    got_q = _call(native.rope_encode_and_cache_write, c, True, KVQuantMode.NVFP4)
    _bytes_equal(c["kv_cache"], want_cache, "cache")
    _bytes_equal(got_q, want_q, "query")
    with pytest.raises(ValueError, match="the native rotary write was forced but cannot run this call: key is on "
                                         "cpu: it runs on CUDA"):
        _call(native.rope_encode_and_cache_write, c, True, KVQuantMode.NVFP4, force=True)
    monkeypatch.setenv("KVFUSE_CACHE_WRITE_BACKEND", "native")
    registry.clear_cache()
    try:
        with pytest.raises(ValueError, match="forced but cannot run this call: key is on cpu"):
            _call(native.rope_encode_and_cache_write, c, True, KVQuantMode.NVFP4)
    finally:
        monkeypatch.delenv("KVFUSE_CACHE_WRITE_BACKEND")
        registry.clear_cache()


def test_rope_write_policy_native_choice():
    from kvfuse.ops import tuning

    policy = tuning.RopeWritePolicy(gather_below={}, native_from={KVQuantMode.FP8_E4M3: 4096},
                                    native_with_query_from={KVQuantMode.NVFP4: 16384})
    assert policy.native(KVQuantMode.FP8_E4M3, 4096, with_query=False)
    assert not policy.native(KVQuantMode.FP8_E4M3, 4095, with_query=False)
    assert not policy.native(KVQuantMode.FP8_E4M3, 8192, with_query=True)
    assert not policy.native(KVQuantMode.NVFP4, 8192, with_query=False)
    assert not policy.native(KVQuantMode.NVFP4, 16383, with_query=True)
    assert policy.native(KVQuantMode.NVFP4, 16384, with_query=True)
    assert not policy.native(KVQuantMode.NVFP4, 1 << 20, with_query=False)
    assert not tuning.RopeWritePolicy(gather_below={}).native(KVQuantMode.FP8_E4M3, 1 << 20, with_query=False)
    for name in ("native_from", "native_with_query_from"):
        for bad in ({KVQuantMode.FP8_E4M3: 0}, {"fp8": 4096}, {KVQuantMode.NVFP4: 1.5}):
            with pytest.raises(ValueError, match=f"{name}=.* must map KVQuantMode formats to positive token counts"):
                tuning.RopeWritePolicy(gather_below={}, **{name: bad})
    sm90 = tuning.ROPE_WRITE_POLICIES["sm90"]
    assert dict(sm90.native_from) == {KVQuantMode.NONE: 1, KVQuantMode.FP8_E4M3: 16, KVQuantMode.NVFP4: 1}
    assert dict(sm90.native_with_query_from) == {KVQuantMode.FP8_E4M3: 16384, KVQuantMode.NVFP4: 16384}


def _reference_result(c, is_neox, mode, contract=False):
    """(cache, rotated query) the reference computes for ``c`` from ``c``'s current (poisoned)
    cache, on the CPU; ``c`` itself is left as it is. ``contract``: the rotation's sum as CUDA
    kernels contract it (``fma(x, cos, rot * sin)``, what the native kernel computes)."""
    cpu = {k: (v.cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in c.items()}
    q = _call(reference.rope_encode_and_cache_write, cpu, is_neox, mode, contract=contract)
    return cpu["kv_cache"], q


def _bytes_equal_but_nan_signs(a, b, what):
    """Byte-equal FP8 caches, except that a NaN may carry either sign (and, in e5m2, any of its
    three NaN mantissas): the GPU's arithmetic returns its canonical (positive) NaN where the CPU
    reference propagates the input's, and torch's vectorized float -> bfloat16 conversion writes
    NaN as 0xFFFF."""
    e5m2 = a.dtype == torch.float8_e5m2
    a, b = a.view(torch.uint8), b.view(torch.uint8)
    differ = a != b

    def nan(x):
        return (x & 0x7F) > 0x7C if e5m2 else (x & 0x7F) == 0x7F

    both_nan = nan(a) & nan(b)
    bad = (differ & ~both_nan).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} bytes differ beyond NaN signs, first at {bad[:4].tolist()}"


def _native_vs_reference(c, is_neox, mode, nan_sign_free=False):
    from kvfuse.ops import native

    assert native.rope_refusal(*_native_args(c, is_neox, mode)) is None
    want_cache, want_q = _reference_result(c, is_neox, mode, contract=True)
    got_q = _call(native.rope_encode_and_cache_write, c, is_neox, mode, force=True)
    # every byte, so padding slots and slots nobody wrote must have kept the sentinel
    if nan_sign_free:
        _bytes_equal_but_nan_signs(c["kv_cache"].cpu(), want_cache, "cache")
    else:
        _bytes_equal(c["kv_cache"].cpu(), want_cache, "cache")
    if c["query"] is None:
        assert got_q.numel() == 0
    else:
        _bytes_equal(got_q.cpu(), want_q, "query")
        assert got_q.is_contiguous()


NATIVE_FORMATS = [FORMATS[3], FORMATS[4], FORMATS[5]]
NATIVE_FORMAT_IDS = ["e4m3", "e5m2", "nvfp4"]


@pytest.mark.gpu
@pytest.mark.parametrize("mode,cache_dtype", NATIVE_FORMATS, ids=NATIVE_FORMAT_IDS)
@pytest.mark.parametrize("is_neox,half,table,rotary_dim,table_dtype", [
    (True, False, False, 128, torch.bfloat16),   # transformers' per-token tables
    (True, True, True, 128, torch.float32),      # vLLM-style float32 cos/sin cache read at positions
    (False, True, True, 64, torch.bfloat16),     # GPT-J, half-width table, partial rotary
    (False, False, False, 128, torch.float32),
    (True, False, True, 64, torch.bfloat16),     # NeoX partial rotary (units past R pass through)
], ids=["neox", "neox-f32-table-pos", "gptj-half-partial", "gptj-f32", "neox-partial"])
@pytest.mark.parametrize("T", [1, 7, 64, 533, 1100])
def test_gpu_native_bit_exact(mode, cache_dtype, is_neox, half, table, rotary_dim, table_dtype, T):
    """Every rotary setup against the reference; FP8 takes 8-element units up to 533 tokens and
    16-element ones at 1100 (KVFUSE_ROPE_FP8_NARROW_BELOW in csrc/cuda/cache_write.cu), or, in
    NeoX launches from 64 tokens of 8 heads (64, 533, 1100), unit pairs (KVFUSE_ROPE_PAIRS_FROM; over
    any table for these bfloat16 keys; NVFP4 keeps single units up to 2047 tokens of 8 heads,
    test_gpu_native_unit_pairs)."""
    c = _case(T, 32, 8, 128, mode, cache_dtype, rotary_dim=rotary_dim, half=half, table=table, seed=T + rotary_dim,
              device="cuda", num_blocks=T // BLOCK + 8)
    c["cos"], c["sin"] = c["cos"].to(table_dtype), c["sin"].to(table_dtype)
    _native_vs_reference(c, is_neox, mode)
    # and without a query: one launch, the cache alone
    c2 = _case(T, 32, 8, 128, mode, cache_dtype, rotary_dim=rotary_dim, half=half, table=table, seed=T + 1,
               device="cuda", num_blocks=T // BLOCK + 8)
    c2["cos"], c2["sin"] = c2["cos"].to(table_dtype), c2["sin"].to(table_dtype)
    c2["query"] = None
    _native_vs_reference(c2, is_neox, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,cache_dtype", NATIVE_FORMATS[:2], ids=NATIVE_FORMAT_IDS[:2])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 2.0**-20), (1.0, 0.37), (2.0**65, 1.0)],
                         ids=["one", "pow2", "pow2-and-other", "pow2-outside-window"])
@pytest.mark.parametrize("is_neox,half,table,table_dtype", [
    (True, False, False, torch.bfloat16),  # transformers' per-token tables
    (True, True, True, torch.float32),     # the pass's float32 half tables, read at positions
    (False, False, False, torch.float32),  # GPT-J: single units
], ids=["neox", "neox-f32-half-pos", "gptj-f32"])
@pytest.mark.parametrize("T", [7, 67, 1031, 4099, 4611])
def test_gpu_native_fp8_every_division(mode, cache_dtype, scales, is_neox, half, table, table_dtype, T):
    """FP8 rotary writes under each division of the encode (one product where both scales are
    powers of two, the corrected reciprocal, div.rn outside the fast window), in 8-element units
    (T = 7, and GPT-J's at 67), 16-element units or unit pairs with key and value in separate
    threads (67, just past KVFUSE_ROPE_PAIRS_FROM, and 1031: a wave; 4099: many, ManyWaves) and
    together (4611). Without a query: the query's kernel does not divide."""
    c = _case(T, 32, 8, 128, mode, cache_dtype, half=half, table=table, seed=T, device="cuda",
              num_blocks=T // BLOCK + 8)
    c["cos"], c["sin"] = c["cos"].to(table_dtype), c["sin"].to(table_dtype)
    c["k_scale"], c["v_scale"] = (torch.tensor(s, device="cuda") for s in scales)
    c["query"] = None
    _native_vs_reference(c, is_neox, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("is_neox,half,table,rotary_dim,table_dtype", [
    (True, False, False, 128, None),          # transformers' per-token tables in the key's dtype
    (True, True, True, 128, torch.float32),   # float32 cos/sin cache read at positions
    (False, True, True, 64, None),            # GPT-J, half-width table, partial rotary
    (True, False, True, 64, None),            # NeoX partial rotary
], ids=["neox", "neox-f32-table-pos", "gptj-half-partial", "neox-partial"])
@pytest.mark.parametrize("T", [1, 7, 64, 533, 1100, 2053, 4099])
def test_gpu_native_16bit_caches(dtype, is_neox, half, table, rotary_dim, table_dtype, T):
    """Unquantized caches of the key's dtype: the rotated key rounded to it and stored as it is,
    the value copied. NeoX keys in pairs of 8-element units (PairRotation, KVFUSE_ROPE_16BIT_PAIRS_FROM),
    key and value rows in separate threads up to 2053 tokens and together at 4099 (262336 pair
    items, KVFUSE_ROPE_UNPAIRED_BELOW_ITEMS), rows loaded there before the table columns
    (KVFUSE_ROPE_16BIT_PAIRED_ROWS_FIRST); in separate threads, rows loaded before the table
    columns up to 1100 tokens and after them at 2053 (131392 pair items,
    KVFUSE_ROPE_16BIT_ROWS_FIRST_BELOW_ITEMS); GPT-J in single units, 8-element up to 533 tokens and
    16-element from 1100 (KVFUSE_ROPE_FP8_NARROW_BELOW), paired at 4099; with and without the query."""
    for with_query in (True, False):
        c = _case(T, 32, 8, 128, KVQuantMode.NONE, dtype, in_dtype=dtype, rotary_dim=rotary_dim, half=half,
                  table=table, seed=T + rotary_dim + with_query, device="cuda", num_blocks=T // BLOCK + 8)
        if table_dtype is not None:
            c["cos"], c["sin"] = c["cos"].to(table_dtype), c["sin"].to(table_dtype)
        if not with_query:
            c["query"] = None
        _native_vs_reference(c, is_neox, KVQuantMode.NONE)


@pytest.mark.gpu
@pytest.mark.parametrize("d,hq,h,in_dtype", [(64, 4, 2, torch.float16), (256, 8, 1, torch.bfloat16),
                                             (128, 12, 3, torch.float16)], ids=["d64-fp16", "d256", "d128-3heads"])
@pytest.mark.parametrize("block", [16, 5, 32], ids=lambda b: f"page{b}")
@pytest.mark.parametrize("mode,cache_dtype", NATIVE_FORMATS, ids=NATIVE_FORMAT_IDS)
def test_gpu_native_shapes_and_pages(d, hq, h, in_dtype, block, mode, cache_dtype):
    """Head sizes 64/256, fp16 inputs, odd head counts, NVFP4 pages of every V-scale layout."""
    c = _case(533, hq, h, d, mode, cache_dtype, in_dtype=in_dtype, half=block == 5, table=block == 32,
              seed=block * d, device="cuda", num_blocks=533 // block + 8, block=block)
    _native_vs_reference(c, block != 32, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("d,rotary_dim", [(64, 32), (80, 64), (96, 96), (192, 128), (256, 256)],
                         ids=["d64-r32", "d80-r64", "d96", "d192-r128", "d256"])
@pytest.mark.parametrize("T", [7, 533, 3000])
@pytest.mark.parametrize("mode,cache_dtype", NATIVE_FORMATS, ids=NATIVE_FORMAT_IDS)
def test_gpu_native_neox_partners(d, rotary_dim, T, mode, cache_dtype):
    """NeoX partners both ways: by warp shuffle where a head's units share a warp (head sizes 64
    and 256, in 16-element units and, for FP8 at T = 7, in 8-element units: partners 1 to 16 lanes
    apart) and by a second load where they do not (80, 96, 192); 3 KV and 5 query heads, so the
    last warp of both launches is partly without units. FP8 at T = 533 and 3000 takes unit pairs
    (KVFUSE_ROPE_PAIRS_FROM in csrc/cuda/cache_write.cu); NVFP4 16-element units throughout."""
    c = _case(T, 5, 3, d, mode, cache_dtype, rotary_dim=rotary_dim, seed=T + d, device="cuda",
              num_blocks=T // BLOCK + 8)
    _native_vs_reference(c, True, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("T,h,d,rotary_dim,is_neox,table,heads_apart", [
    (16411, 8, 128, 128, True, False, False),  # ~4100 blocks, the last one partly empty
    (2053, 3, 80, 64, False, True, False),     # 15 units a token: blocks end inside tokens; GPT-J partial
    (1031, 40, 128, 128, True, True, False),   # 320 units a token: a token spans two blocks
    (1200, 8, 256, 128, True, False, False),   # NeoX partial over D = 256, partners 4 lanes apart
    (1100, 8, 128, 128, True, False, True),    # K / V heads apart within a token's row
], ids=["16411", "2053-d80-gptj", "1031-40heads", "1200-d256-partial", "1100-heads-apart"])
@pytest.mark.parametrize("mode,cache_dtype", NATIVE_FORMATS, ids=NATIVE_FORMAT_IDS)
def test_gpu_native_prefill_shapes(T, h, d, rotary_dim, is_neox, table, heads_apart, mode, cache_dtype):
    """Prefill-sized rotary writes (16-element units, key and value paired in one thread) away
    from the benchmark's 8 x 128: grids of thousands of blocks, blocks that start and end inside a
    token, partial rotary over a wide head, and K / V heads that are not adjacent in their rows.
    Sentinel cache, a slot of -1, float32 tables read at positions where ``table``."""
    c = _case(T, 4, h, d, mode, cache_dtype, rotary_dim=rotary_dim, table=table, seed=T + h,
              device="cuda", num_blocks=T // BLOCK + 8)
    if table:
        c["cos"], c["sin"] = c["cos"].float(), c["sin"].float()
    if heads_apart:
        for name in ("key", "value"):
            wide = torch.zeros(T, h, 2 * d, dtype=c[name].dtype, device="cuda")
            wide[..., :d] = c[name]
            c[name] = wide[..., :d]
    c["query"] = None
    _native_vs_reference(c, is_neox, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("T,h,d,rotary_dim", [(5123, 8, 128, 128), (4099, 8, 128, 128), (3100, 8, 128, 128),
                                              (2053, 4, 256, 192), (5501, 6, 64, 64), (2000, 8, 80, 64)],
                         ids=["5123", "4099", "3100", "d256-r192", "d64", "d80-r64"])
@pytest.mark.parametrize("half,table,table_dtype", [
    (False, False, torch.bfloat16), (True, False, torch.bfloat16), (False, False, torch.float32),
    (True, False, torch.float32), (True, True, torch.float32)],
    ids=["bf16", "bf16-half", "f32", "f32-half", "f32-half-pos"])
@pytest.mark.parametrize("mode,cache_dtype", NATIVE_FORMATS, ids=NATIVE_FORMAT_IDS)
def test_gpu_native_unit_pairs(T, h, d, rotary_dim, half, table, table_dtype, mode, cache_dtype):
    """NeoX launches of 4096 16-element units and more for FP8 (over float32 tables, and over
    16-bit ones for these bfloat16 keys), of 131072 and more for NVFP4 (KVFUSE_ROPE_PAIRS_FROM,
    KVFUSE_ROPE_NVFP4_PAIRS_FROM), hold a unit and its rotation partner in one thread
    (PairRotation), paired with the value row or not by size; FP8 hands its rotated elements to the
    encode as floats (KVFUSE_ROPE_WIDENED_OUT). Every table form (full / half width, bf16 / float32,
    read at positions), an unrotated tail of pairs (d256-r192) and one that does not split into
    NVFP4 pairs (d80-r64: single units), odd token counts, a sentinel cache and a slot of -1.
    FP8 holds the value pair in the key pair's thread from 294912 pair items (5123 tokens:
    KVFUSE_ROPE_FP8_UNPAIRED_BELOW_ITEMS), NVFP4 from 163840 (5123 tokens, just past
    KVFUSE_ROPE_NVFP4_UNPAIRED_BELOW_ITEMS, at 3 blocks per SM). Grids of one to two
    waves of key and value rows in separate threads run the prefetching kernel
    (KVFUSE_ROPE_PREFETCH; 132 SMs): NVFP4 at 3100 and 4099 tokens, FP8 at d256-r192 and d64.
    Where key and value rows are in separate threads, FP8 loads each thread's rows before its
    slot and table columns (KVFUSE_ROPE_ROWS_FIRST), NVFP4 its table columns first. FP8 pairs
    holding the value pair over bf16 half tables (5123) run at 48 registers
    (KVFUSE_ROPE_PAIR_FP8_16BIT_HALF_SMALL_BLOCKS); unpaired launches of more than a wave over
    every table form but full-width float32 at 40-48 (ManyWaves or prefetching:
    KVFUSE_ROPE_PAIR_FP8_*UNPAIRED_BLOCKS), FP8 over bf16 half tables prefetching at 3100."""
    c = _case(T, 4, h, d, mode, cache_dtype, rotary_dim=rotary_dim, half=half, table=table, seed=T + d + half,
              device="cuda", num_blocks=T // BLOCK + 8)
    pairs_from = 131072 if mode is KVQuantMode.NVFP4 else 4096
    assert T * h * (d // 16) >= pairs_from or (mode is KVQuantMode.NVFP4 and d - rotary_dim == 16)
    c["cos"], c["sin"] = c["cos"].to(table_dtype), c["sin"].to(table_dtype)
    c["query"] = None
    _native_vs_reference(c, True, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("T,h", [(64, 2), (64, 8), (1024, 8), (5123, 8)],
                         ids=["single-units", "pairs", "pairs-1024", "paired-pairs"])
@pytest.mark.parametrize("half,table_dtype", [(False, torch.bfloat16), (True, torch.bfloat16), (True, torch.float32)],
                         ids=["bf16", "bf16-half", "f32-half"])
@pytest.mark.parametrize("scales", [(0.75, 1.5), (0.5, 0.25)], ids=["reciprocal", "exact"])
@pytest.mark.parametrize("mode,cache_dtype", NATIVE_FORMATS[:2], ids=NATIVE_FORMAT_IDS[:2])
def test_gpu_native_special_values(T, h, half, table_dtype, scales, mode, cache_dtype):
    """inf / NaN / huge keys and values rotate and encode as the reference does (saturation, NaN
    bytes), in every FP8 launch shape: 8-element single units (64 tokens of 2 x 128), unit pairs
    with key and value rows in separate threads (64 and 1024 tokens of 8 x 128) and with the value
    pair in the key pair's thread (5123 tokens), over power-of-two scales (exact division) and
    others. A NaN byte is rare, so each of these takes the kernels' NaN branch for a few units
    only: a NaN key element (its rotation partner turns NaN too), an infinite key element beside
    finite partners, a key row that overflows once rotated, and NaN / inf values."""
    c = _case(T, 4, h, 128, mode, cache_dtype, half=half, seed=21 + T, device="cuda", num_blocks=T // BLOCK + 8)
    c["cos"], c["sin"] = c["cos"].to(table_dtype), c["sin"].to(table_dtype)
    c["k_scale"] = torch.tensor(scales[0], device="cuda")
    c["v_scale"] = torch.tensor(scales[1], device="cuda")
    c["query"] = None
    k, v = c["key"], c["value"]
    k[3, 0, 5] = float("inf")
    k[4, 1, 70] = float("nan")
    k[5, 0, :] = 3.0e38
    k[T - 1, h - 1, 127] = float("-inf")
    v[6, 1, 9] = float("nan")
    v[7, 0, 100] = float("-inf")
    v[T - 2, h - 1, :8] = float("nan")
    _native_vs_reference(c, True, mode, nan_sign_free=True)


@pytest.mark.gpu
def test_gpu_native_routing_and_fallback(monkeypatch):
    """The registry gives FP8/NVFP4 rotary writes to the native backend on CUDA, which runs its
    kernel where the policy measured it faster and Triton's elsewhere; a call it refuses
    (NeoX over rotary_dim 80) runs Triton's kernel, bit-exact all the same, and raises when the
    native backend is forced."""
    from kvfuse.ops import native, tuning
    from kvfuse.ops.triton import rope_kv_write

    registry.clear_cache()
    assert registry.select("rope_encode_and_cache_write", "cuda", KVQuantMode.FP8_E4M3).name == "native"
    assert registry.select("rope_encode_and_cache_write", "cuda", KVQuantMode.NVFP4).name == "native"
    assert registry.select("rope_encode_and_cache_write", "cuda", KVQuantMode.NONE).name == "native"
    assert registry.select("rope_encode_and_cache_write", "cuda", KVQuantMode.FP8_PER_TOKEN_HEAD).name == "triton"
    triton_calls = []
    triton_write = rope_kv_write.rope_encode_and_cache_write
    monkeypatch.setattr(rope_kv_write, "rope_encode_and_cache_write",
                        lambda *a, **k: triton_calls.append(a[1].shape[0]) or triton_write(*a, **k))
    policy = tuning.rope_write_policy(torch.device("cuda"))
    for T, with_query in ((64, True), (64, False), (4096, False)):
        c = _case(T, 32, 8, 128, KVQuantMode.FP8_E4M3, torch.float8_e4m3fn, seed=T, device="cuda",
                  num_blocks=T // BLOCK + 8)
        if not with_query:
            c["query"] = None
        want_cache, _ = _reference_result(c, True, KVQuantMode.FP8_E4M3)
        before = len(triton_calls)
        OP(c["query"], c["key"], c["value"], c["kv_cache"], c["slot_mapping"], c["k_scale"], c["v_scale"], c["cos"],
           c["sin"], None, 128, True, int(KVQuantMode.FP8_E4M3), "l0")
        _bytes_equal(c["kv_cache"].cpu(), want_cache, f"cache T={T} query={with_query}")
        ran_triton = len(triton_calls) > before
        assert ran_triton == (not policy.native(KVQuantMode.FP8_E4M3, T, with_query)), (T, with_query)
    c = _case(33, 4, 2, 80, KVQuantMode.FP8_E4M3, torch.float8_e4m3fn, rotary_dim=80, seed=5, device="cuda",
              num_blocks=20)
    assert "rotary_dim=80 with NeoX pairs" in native.rope_refusal(*_native_args(c, True, KVQuantMode.FP8_E4M3))
    want_cache, _ = _reference_result(c, True, KVQuantMode.FP8_E4M3)
    q = OP(c["query"], c["key"], c["value"], c["kv_cache"], c["slot_mapping"], c["k_scale"], c["v_scale"], c["cos"],
           c["sin"], None, 80, True, int(KVQuantMode.FP8_E4M3), "l0")
    _bytes_equal(c["kv_cache"].cpu(), want_cache, "cache (Triton fallback)")
    assert q.shape == c["query"].shape
    monkeypatch.setenv("KVFUSE_CACHE_WRITE_BACKEND", "native")
    registry.clear_cache()
    try:
        with pytest.raises(ValueError, match="the native rotary write was forced but cannot run this call: "
                                             "rotary_dim=80 with NeoX pairs"):
            OP(c["query"], c["key"], c["value"], c["kv_cache"], c["slot_mapping"], c["k_scale"], c["v_scale"],
               c["cos"], c["sin"], None, 80, True, int(KVQuantMode.FP8_E4M3), "l0")
    finally:
        monkeypatch.delenv("KVFUSE_CACHE_WRITE_BACKEND")
        registry.clear_cache()
