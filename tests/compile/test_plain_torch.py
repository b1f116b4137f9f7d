"""User-written encodings before kvfuse::cache_write: fused when exact, left alone with a reason."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvfuse import KVQuantMode
from kvfuse.kv_cache import fp8_max
from kvfuse.ops import reference
from kvfuse.passes._graph import CACHE_WRITE, ENCODE_KV
from kvfuse.passes.fuse_encode_cache_write import run as fuse_run

from compile_util import BLOCK, NUM_BLOCKS, SENTINEL, assert_bytes_equal, make_inputs, snapshot_backend

H, D = 2, 64
E4M3 = torch.float8_e4m3fn


class UserWrites(nn.Module):
    """Cache writes with hand-written encodings, one per 'layer', in several styles."""

    def __init__(self, style, scale=2.0):
        super().__init__()
        self.style = style
        self.register_buffer("k_scale", torch.tensor(scale))
        self.register_buffer("v_scale", torch.tensor(scale * 1.5))
        self.register_buffer("per_head", torch.full((H, 1), scale))

    def forward(self, k, v, cache, slots):
        m = fp8_max(KVQuantMode.FP8_E4M3)
        s = self.style
        extra = None
        if s == "div":
            kr = (k.float() / self.k_scale).clamp(-m, m).to(E4M3)
            vr = torch.clamp(v.float() / self.v_scale, min=-m, max=m).to(E4M3)
        elif s == "mul":
            kr = (k.float() * self.k_scale).clamp(-m, m).to(E4M3)
            vr = (self.v_scale * v.float()).clamp(max=m).clamp(min=-m).to(E4M3)
        elif s == "native":
            kr, vr = k.to(torch.float16), v.to(torch.float16)
        elif s == "per_head_scale":
            kr = (k.float() / self.per_head).clamp(-m, m).to(E4M3)
            vr = (v.float() / self.v_scale).clamp(-m, m).to(E4M3)
        elif s == "other_user":
            kr = (k.float() / self.k_scale).clamp(-m, m).to(E4M3)
            vr = (v.float() / self.v_scale).clamp(-m, m).to(E4M3)
            extra = kr.float().sum()
        elif s == "bf16_division":
            kr = (k / self.k_scale).clamp(-m, m).to(E4M3)
            vr = (v.float() / self.v_scale).clamp(-m, m).to(E4M3)
        elif s == "wrong_bounds":
            big = fp8_max(KVQuantMode.FP8_E5M2)
            kr = (k.float() / self.k_scale).clamp(-big, big).to(E4M3)
            vr = (v.float() / self.v_scale).clamp(-m, m).to(E4M3)
        mode = KVQuantMode.NONE if s == "native" else KVQuantMode.FP8_E4M3
        torch.ops.kvfuse.cache_write(kr, vr, cache, slots, int(mode), f"user.{s}")
        return extra if extra is not None else k.sum()


def _run(style, scale=2.0, T=533):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(T)
    k = (torch.randn(T, H, D, generator=g) * 300).bfloat16()
    v = (torch.randn(T, H, D, generator=g) * 300).bfloat16()
    k[0, 0, :4] = torch.tensor([float("nan"), 1e6, -1e6, 0.0])
    dtype = torch.float16 if style == "native" else E4M3
    nblocks = (T + BLOCK - 1) // BLOCK + 2
    cache = torch.empty(nblocks, 2, BLOCK, H, D, dtype=dtype)
    cache.view(torch.uint8).fill_(SENTINEL)
    slots = torch.randperm(nblocks * BLOCK, generator=g)[:T]
    slots[::5] = -1
    model = UserWrites(style, scale)
    expected = cache.clone()
    with torch.no_grad():
        model(k, v, expected, slots)  # eager: the user's own encoding, unfused
    be = snapshot_backend()
    with torch.no_grad():
        torch.compile(model, backend=be, fullgraph=True)(k, v, cache, slots)
    return be, cache, expected, model, (k, v, slots)


@pytest.mark.parametrize("style", ["div", "native"])
def test_plain_encodings_fuse_bit_exact(style):
    be, cache, expected, *_ = _run(style)
    assert be.pass_manager.after == [{"encode_and_cache_write": 1}], be.pass_manager.after
    (rec,) = be.report
    assert rec.fused and rec.layer_name == f"user.{style}" and "plain torch" in rec.reason, rec
    assert_bytes_equal(cache, expected, style)


def test_inverse_scale_fuses_exact_for_powers_of_two():
    be, cache, expected, *_ = _run("mul", scale=0.25)
    assert be.pass_manager.after == [{"encode_and_cache_write": 1}]
    assert be.report[0].fused and "1/inv_scale" in be.report[0].reason
    # 0.25 and 0.375 = 1.5 * 0.25: x * 0.25 == x / 4 exactly; x * 0.375 vs x / (1/0.375) may differ.
    assert_bytes_equal(cache[:, 0], expected[:, 0], "key (power-of-two inv_scale)")


def test_inverse_scale_within_one_fp8_step_otherwise():
    be, cache, expected, *_ = _run("mul", scale=0.3)
    assert be.report[0].fused
    a, b = cache.float(), expected.float()
    both_nan = a.isnan() & b.isnan()
    # One e4m3 step at |x| is at most |x| / 8 (3 mantissa bits); the subnormal step is 2**-9.
    tol = torch.maximum(b.abs() / 8, torch.tensor(2.0**-9))
    assert ((a - b).abs() <= tol)[~both_nan].all()
    assert (cache.view(torch.uint8) != expected.view(torch.uint8)).float().mean() < 0.01


@pytest.mark.parametrize("style,reason", [
    ("per_head_scale", "not a per-tensor scalar"),
    ("other_user", "other users"),
    ("bf16_division", "not float32"),
    ("wrong_bounds", "finite range of FP8_E4M3"),
])
def test_left_alone_with_reason(style, reason):
    be, cache, expected, *_ = _run(style)
    assert be.pass_manager.after == be.pass_manager.before, be.pass_manager.after
    (rec,) = be.report
    assert not rec.fused and reason in rec.reason, rec.reason
    assert rec.kv_quant_mode is KVQuantMode.FP8_E4M3
    assert_bytes_equal(cache, expected, style)


def test_modes_disagree_is_left_alone():
    """A hand-built graph whose encode_kv claims another mode than the cache write."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = torch.fx.Graph()
    with FakeTensorMode() as fm:
        metas = {"k": torch.empty(7, 2, 16, dtype=torch.bfloat16), "v": torch.empty(7, 2, 16, dtype=torch.bfloat16),
                 "s": torch.empty(()), "cache": torch.empty(4, 2, 8, 2, 16, dtype=E4M3),
                 "slots": torch.empty(7, dtype=torch.long)}
        rows = torch.empty(7, 2, 16, dtype=E4M3)
    ph = {}
    for name, m in metas.items():
        ph[name] = g.placeholder(name)
        ph[name].meta["val"] = m
    kr = g.call_function(ENCODE_KV, (ph["k"], ph["s"], int(KVQuantMode.FP8_E5M2), E4M3, "x"))
    vr = g.call_function(ENCODE_KV, (ph["v"], ph["s"], int(KVQuantMode.FP8_E4M3), E4M3, "x"))
    kr.meta["val"] = vr.meta["val"] = rows
    g.call_function(CACHE_WRITE, (kr, vr, ph["cache"], ph["slots"], int(KVQuantMode.FP8_E4M3), "x"))
    g.output(None)
    (rec,) = fuse_run(g)
    assert not rec.fused and "modes disagree" in rec.reason, rec.reason
    assert sum(n.target is CACHE_WRITE for n in g.nodes) == 1
