"""Paged cache writes in plain PyTorch (index_put_ / index_copy_ / slice assignment by slot) are
fused into kvfuse::encode_and_cache_write when that is bit-exact, and reported with a reason otherwise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvfuse import KVQuantMode
from kvfuse.passes import fuse_plain_cache_write
from kvfuse.passes.manager import graph_op_counts

from compile_util import SENTINEL, assert_bytes_equal, snapshot_backend

E4M3 = torch.float8_e4m3fn
H, D, BS, NB = 2, 16, 4, 5


def _fp8(x, scale):
    return (x.float() / scale).clamp(-448, 448).to(E4M3)


def _write(style, k, v, cache, slots, scale):
    """One layer's K/V write, in the ways a user writes it by hand."""
    blk, off = slots // BS, slots % BS
    if style == "slice_assign":
        cache[blk, 0, off] = _fp8(k, scale)
        cache[blk, 1, off] = _fp8(v, scale)
    elif style == "index_put_":
        cache.index_put_((blk, torch.zeros_like(blk), off), _fp8(k, scale))
        cache.index_put_((blk, torch.ones_like(blk), off), _fp8(v, scale))
    elif style == "two_views":
        kc, vc = cache.unbind(1)
        vc[blk, off] = _fp8(v, scale)  # V first: the order of the two writes does not matter
        kc[blk, off] = _fp8(k, scale)
    elif style == "flat_view":
        flat = cache.view(-1, H, D)
        row = blk * (2 * BS) + off
        flat[row] = _fp8(k, scale)
        flat[row + BS] = _fp8(v, scale)
    elif style == "index_copy_uint8":
        flat = cache.view(torch.uint8).view(-1, H, D)
        row = blk * (2 * BS) + off
        flat.index_copy_(0, row, _fp8(k, scale).view(torch.uint8))
        flat.index_copy_(0, row + BS, _fp8(v, scale).view(torch.uint8))
    elif style == "native":
        cache[blk, 0, off] = k.to(cache.dtype)
        cache[blk, 1, off] = v.to(cache.dtype)
    # Refused forms use the flat view: Inductor's CPU codegen cannot compile an unfused FP8
    # select_scatter ("Promotion for Float8 Types is not supported"), the flat form it can.
    elif style == "wrong_row":
        flat = cache.view(-1, H, D)
        flat[blk * (2 * BS) + off] = _fp8(k, scale)
        flat[blk * (2 * BS) + off + 1] = _fp8(v, scale)  # off + 1 overflows into the V half
    elif style == "bf16_scaling":
        flat = cache.view(-1, H, D)
        flat[blk * (2 * BS) + off] = (k / scale.bfloat16()).clamp(-448, 448).to(E4M3)
        flat[blk * (2 * BS) + off + BS] = _fp8(v, scale)
    elif style == "k_only":
        cache.view(-1, H, D)[blk * (2 * BS) + off] = _fp8(k, scale)
    else:
        raise AssertionError(style)


class PlainLayer(nn.Module):
    def __init__(self, style, scale):
        super().__init__()
        self.style = style
        self.register_buffer("scale", torch.tensor(scale))

    def forward(self, k, v, cache, slots):
        _write(self.style, k, v, cache, slots, self.scale)
        # Read the written cache back, so the fused write's result must feed later nodes.
        bits = {1: torch.uint8, 2: torch.int16}[cache.dtype.itemsize]
        return cache.view(bits)[slots // BS].to(torch.int32).sum()


def _inputs(seed, dtype=E4M3, T=11, padding=True):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(T, H, D, generator=g) * 200).bfloat16()
    v = (torch.randn(T, H, D, generator=g) * 200).bfloat16()
    k[0, 0, :3] = torch.tensor([float("nan"), 1e6, -1e6])
    slots = torch.randperm(NB * BS, generator=g)[:T]
    if padding:
        slots[[2, 7]] = -1
        slots[0] = NB * BS - 1  # a real token in the very slot -1 lands on
    cache = torch.empty(NB, 2, BS, H, D, dtype=dtype)
    cache.view(torch.uint8).fill_(SENTINEL)
    return k, v, cache, slots


def _compile_and_compare(style, seed=0, dtype=E4M3, padding=True, scale=0.75):
    torch._dynamo.reset()
    k, v, cache, slots = _inputs(seed, dtype, padding=padding)
    model = PlainLayer(style, scale)
    expected = cache.clone()
    with torch.no_grad():
        eager_out = model(k, v, expected, slots)
        be = snapshot_backend()
        out = torch.compile(model, backend=be, fullgraph=True)(k, v, cache, slots)
    return be, cache, expected, out, eager_out


@pytest.mark.parametrize("style", ["slice_assign", "index_put_", "two_views", "flat_view"])
def test_plain_fp8_writes_fuse_bit_exact_with_padding(style):
    be, cache, expected, out, eager_out = _compile_and_compare(style, seed=hash(style) % 1000)
    (rec,) = be.report
    assert rec.fused and rec.kv_quant_mode is KVQuantMode.FP8_E4M3, rec
    assert "plain cache write" in rec.reason and "slot -1" in rec.reason, rec.reason
    assert be.pass_manager.after == [{"encode_and_cache_write": 1}], be.pass_manager.after
    (graph,) = be.pass_manager.graphs_after
    assert not any(n.target is torch.ops.aten.index_put.default for n in graph.nodes)
    # Padding rows land in the last slot exactly as PyTorch's wrap-around indexing puts them.
    assert_bytes_equal(cache, expected, style)
    assert int(out) == int(eager_out)


def test_index_copy_through_uint8_view_fuses():
    # Eager index_copy_ refuses negative indices, so this comparison has no padding tokens.
    be, cache, expected, out, eager_out = _compile_and_compare("index_copy_uint8", seed=5, padding=False)
    (rec,) = be.report
    assert rec.fused and rec.layer_name.startswith("cache "), rec
    assert_bytes_equal(cache, expected, "index_copy_")
    assert int(out) == int(eager_out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_dtype_cast_write_fuses(dtype):
    be, cache, expected, *_ = _compile_and_compare("native", seed=3, dtype=dtype)
    (rec,) = be.report
    assert rec.fused and rec.kv_quant_mode is KVQuantMode.NONE, rec
    assert_bytes_equal(cache, expected, str(dtype))


@pytest.mark.parametrize("style,reason", [
    ("wrong_row", "do not address cache[slot // 4, 0 or 1, slot % 4]"),
    ("bf16_scaling", "not float32"),
    ("k_only", "written 1 time(s)"),
])
def test_unfusable_plain_writes_are_reported(style, reason):
    be, cache, expected, *_ = _compile_and_compare(style, seed=7, padding=False)
    (rec,) = be.report
    assert not rec.fused and "plain cache write left unfused" in rec.reason and reason in rec.reason, rec.reason
    assert be.pass_manager.after == be.pass_manager.before == [{}]
    assert_bytes_equal(cache, expected, style)


def test_fuse_false_reports_what_would_fuse():
    torch._dynamo.reset()
    k, v, cache, slots = _inputs(11)
    be = snapshot_backend(fuse=False)
    with torch.no_grad():
        torch.compile(PlainLayer("flat_view", 1.0), backend=be, fullgraph=True)(k, v, cache, slots)
    (rec,) = be.report
    assert not rec.fused and rec.reason.startswith("fusion disabled") and "would be" in rec.reason


def test_encode_kv_rows_written_by_hand_keep_the_layer_name():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("s", torch.tensor(2.0))

        def forward(self, k, v, cache, slots):
            mode = int(KVQuantMode.FP8_E5M2)
            kr = torch.ops.kvfuse.encode_kv(k, self.s, mode, torch.float8_e5m2, "model.layers.4.attn")
            vr = torch.ops.kvfuse.encode_kv(v, self.s, mode, torch.float8_e5m2, "model.layers.4.attn")
            cache[slots // BS, 0, slots % BS] = kr
            cache[slots // BS, 1, slots % BS] = vr
            return k.sum()

    torch._dynamo.reset()
    k, v, cache, slots = _inputs(13, dtype=torch.float8_e5m2)
    expected = cache.clone()
    be = snapshot_backend()
    with torch.no_grad():
        M()(k, v, expected, slots)
        torch.compile(M(), backend=be, fullgraph=True)(k, v, cache, slots)
    (rec,) = be.report
    assert rec.fused and rec.layer_name == "model.layers.4.attn" and rec.kv_quant_mode is KVQuantMode.FP8_E5M2
    assert "kvfuse::encode_kv" in rec.reason
    assert_bytes_equal(cache, expected, "encode_kv + index_put")


def _graph_of(fn, *args):
    """The graph as Inductor hands it to kvfuse's passes."""
    be = snapshot_backend()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=be, fullgraph=True)(*args)
    (graph,) = be._manager.graphs_before
    return graph


def test_explain_no_writes_names_the_problem():
    def hf_style(k, k_cache, slots):  # transformers' continuous-batching layout: (slots, heads, dim)
        k_cache.index_copy_(0, slots, k)
        return k.sum()

    g = torch.Generator().manual_seed(0)
    k = torch.randn(6, H, D, generator=g)
    graph = _graph_of(hf_style, k, torch.zeros(NB * BS, H, D), torch.randperm(NB * BS, generator=g)[:6])
    (line,) = fuse_plain_cache_write.explain_no_writes(graph)
    assert "is not a kvfuse cache (num_blocks, 2, block_size, heads, row_dim)" in line, line

    graph = _graph_of(lambda x: x * 2, k)
    (line,) = fuse_plain_cache_write.explain_no_writes(graph)
    assert line.startswith("the graph writes no KV cache"), line
    assert graph_op_counts(graph) == {}
