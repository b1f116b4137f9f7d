"""The rotary fusion pass through the real backend: op counts before/after, the report, and
outputs and cache bytes equal to the unfused compiled graph, for each rotary style and for a
bf16 skip layer beside FP8 and NVFP4 layers in one graph."""

from __future__ import annotations

import operator

import pytest
import torch

import kvfuse
from kvfuse import KVCacheConfig, KVQuantMode
from kvfuse.passes.fuse_rope_cache_write import ROPE_WRITE

from compile_util import BLOCK, NUM_BLOCKS, SENTINEL, assert_bytes_equal, nodes_of, snapshot_backend
from rope_models import HKV, HQ, RopeModel
from kvfuse import AttentionMetadata, allocate_kv_cache


def _inputs(T, head_size, seed, context=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, HQ * head_size, generator=g).bfloat16()
    total = context + T
    perm = torch.randperm(NUM_BLOCKS, generator=g)[: (total + BLOCK - 1) // BLOCK].to(torch.int32)
    positions = torch.arange(context, total)
    slots = perm[positions // BLOCK].long() * BLOCK + positions % BLOCK
    slots[T // 2] = -1
    md = AttentionMetadata(slot_mapping=slots, block_table=perm.unsqueeze(0),
                           seq_lens=torch.tensor([total], dtype=torch.int32),
                           query_start_loc=torch.tensor([0, T], dtype=torch.int32))
    # positions far from 0, where cos/sin carry many bits
    return x, md, positions + 1000


def _caches(model):
    out = []
    for attn in model.attn:
        c = allocate_kv_cache(attn.spec, NUM_BLOCKS, BLOCK)
        c.view(torch.uint8).fill_(SENTINEL)
        out.append(c)
    return out


def _run(model, be, x, md, positions):
    caches = _caches(model)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=be, fullgraph=True)(x, caches, md, positions)
    return out, caches


def _graph_count(graph, target):
    return sum(1 for n in graph.nodes if n.op == "call_function" and n.target is target)


def _assert_same_as_unfused(model, be, x, md, positions):
    out, caches = _run(model, be, x, md, positions)
    base = kvfuse.make_backend(fuse=False, force_disable_caches=True)
    ref_out, ref_caches = _run(model, base, x, md, positions)
    assert not any(r.fused for r in base.report)
    for i, (c, r) in enumerate(zip(caches, ref_caches)):
        assert_bytes_equal(c, r, f"layer {i} cache")
        written = (c.view(torch.uint8) != SENTINEL).any().item()
        assert written, f"layer {i} wrote nothing"
    assert_bytes_equal(out, ref_out, "output")
    return out


def test_each_rotary_style_fuses_bit_exact():
    styles = ("hf_neox", "hf_gptj", "hf_partial", "demo", "hf_neox_f32", "hf_neox_cached", "none")
    model = RopeModel(styles, [KVCacheConfig(kv_cache_dtype="fp8")] * len(styles), seed=3)
    x, md, positions = _inputs(7, model.head_size, seed=5)
    be = snapshot_backend()
    _assert_same_as_unfused(model, be, x, md, positions)

    snap = be.pass_manager
    assert snap.before == [{"encode_kv": 14, "cache_write": 7, "paged_attention": 7}]
    assert snap.after == [{"rope_encode_and_cache_write": 6, "encode_and_cache_write": 1, "paged_attention": 7}]
    after = snap.graphs_after[0]
    # every rotation is gone (the "none" layer never had one); cos/sin are still computed
    assert _graph_count(after, torch.ops.aten.neg.default) == 0
    assert _graph_count(after, torch.ops.aten.sub.Tensor) == 0
    assert _graph_count(after, torch.ops.aten.cos.default) >= 1

    fused = nodes_of(after, ROPE_WRITE)
    assert [n.target.__name__ for n, _ in fused] == ["auto_functionalized_v2"] * 6
    assert [(a["rotary_dim"], a["is_neox"]) for _, a in fused] == [(32, True), (32, False), (16, True), (32, True),
                                                                   (32, True), (32, True)]
    # Tables the graph computes with each column repeated (cat((f, f)), repeat_interleave(f, 2))
    # reach the op half-width; the demo's are half-width already; gathered rows stay whole.
    assert [tuple(a["cos"].meta["val"].shape) for _, a in fused] == [(7, 16), (7, 16), (7, 8), (7, 16), (7, 16),
                                                                     (7, 32)]
    assert [tuple(a["sin"].meta["val"].shape) for _, a in fused] == [(7, 16), (7, 16), (7, 8), (7, 16), (7, 16),
                                                                     (7, 32)]
    # attention reads the fused op's rotated query
    for node, args in fused:
        q_out = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
        assert len(q_out) == 1 and args["query"] is not None
        assert any(u.target is torch.ops.kvfuse.paged_attention.default for u in q_out[0].users)

    reasons = [r.reason for r in be.report]
    assert all(r.fused and r.kv_quant_mode is KVQuantMode.FP8_E4M3 for r in be.report)
    repeated = "half-width (the graph's tables repeat each column for its partner"
    assert "rotary: fused into rope_encode_and_cache_write (NeoX rotate-half, rotary_dim=32, " + repeated in reasons[0]
    assert "(GPT-J interleaved, rotary_dim=32, " + repeated in reasons[1]
    assert "(NeoX rotate-half, rotary_dim=16, " + repeated in reasons[2]
    assert "(NeoX (demo chunk form), rotary_dim=32, half-width per-token" in reasons[3]
    assert repeated in reasons[4]
    assert "(NeoX rotate-half, rotary_dim=32, full-width per-token" in reasons[5]
    assert all("with the query" in r for r in reasons[:6])
    assert "rotary: not fused: key: it comes from" in reasons[6]


def _repeats_of(fn, *shapes):
    """What the pass finds repeated in the table ``fn`` computes from random inputs of ``shapes``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from kvfuse.passes.fuse_rope_cache_write import _table_repeats

    gm = make_fx(fn, tracing_mode="fake")(*[torch.randn(s) for s in shapes])
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return _table_repeats(out[0] if isinstance(out, (list, tuple)) else out)


@pytest.mark.parametrize("fn, shapes, want", [
    (lambda f: torch.cat((f, f), dim=-1).cos() * 0.5, [(1, 7, 16)], "halves"),
    (lambda f: torch.cat((f, f), dim=2).sin().to(torch.bfloat16)[:, None], [(1, 7, 16)], "halves"),
    (lambda f: torch.repeat_interleave(f, 2, dim=-1).cos(), [(7, 16)], "pairs"),
    # the forms Inductor's decompositions make of both
    (lambda f: f.unsqueeze(-2).expand(7, 2, 16).clone().reshape(7, 32).cos(), [(7, 16)], "halves"),
    (lambda f: f.unsqueeze(-1).expand(7, 16, 2).clone().reshape(7, 32).cos(), [(7, 16)], "pairs"),
    # a per-row factor keeps the repetition; a per-column one, another half or another axis do not
    (lambda f, s: torch.cat((f, f), dim=-1).cos() * s, [(7, 16), (7, 1)], "halves"),
    (lambda f, s: torch.cat((f, f), dim=-1).cos() * s, [(7, 16), (7, 32)], None),
    (lambda f, g: torch.cat((f, g), dim=-1).cos(), [(7, 16), (7, 16)], None),
    (lambda f: torch.cat((f, f), dim=0).cos(), [(7, 32)], None),
    (lambda f: torch.cat((f, f), dim=-1).flip(-1).cos(), [(7, 16)], None),
    (lambda f: torch.cat((f, f), dim=-1).permute(1, 0).cos(), [(32, 16)], None),
    (lambda f: torch.repeat_interleave(f, 3, dim=-1).cos(), [(7, 16)], None),
    (lambda t: t.cos(), [(7, 32)], None),
], ids=["cat", "cat-cast-unsqueeze", "repeat-interleave", "expand-halves", "expand-pairs", "row-factor",
        "column-factor", "two-halves", "cat-rows", "flipped", "transposed", "three-repeats", "input"])
def test_repeated_table_columns_are_recognised_only_where_the_graph_shows_them(fn, shapes, want):
    assert _repeats_of(fn, *shapes) == want


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_skip_layer_beside_fp8_and_nvfp4_layers(v2):
    configs = [KVCacheConfig(kv_cache_dtype="fp8", skip_layers=("0",)), KVCacheConfig(kv_cache_dtype="fp8"),
               KVCacheConfig(kv_cache_dtype="nvfp4")]
    model = RopeModel(("hf_neox", "hf_neox", "demo"), configs, head_size=32, seed=7)
    assert [a.spec.kv_quant_mode for a in model.attn] == [KVQuantMode.NONE, KVQuantMode.FP8_E4M3, KVQuantMode.NVFP4]
    x, md, positions = _inputs(9, 32, seed=8)
    be = snapshot_backend(enable_auto_functionalized_v2=v2)
    _assert_same_as_unfused(model, be, x, md, positions)
    snap = be.pass_manager
    assert snap.after == [{"rope_encode_and_cache_write": 3, "paged_attention": 3}]
    hop = "auto_functionalized_v2" if v2 else "auto_functionalized"
    fused = nodes_of(snap.graphs_after[0], ROPE_WRITE)
    assert [(n.target.__name__, a["kv_quant_mode"]) for n, a in fused] == [
        (hop, int(KVQuantMode.NONE)), (hop, int(KVQuantMode.FP8_E4M3)), (hop, int(KVQuantMode.NVFP4))]
    assert [r.kv_quant_mode for r in be.report] == [KVQuantMode.NONE, KVQuantMode.FP8_E4M3, KVQuantMode.NVFP4]
    assert all("rotary: fused" in r.reason for r in be.report)
    # The bf16 layer hands its rotated key/value to attention (new-token prefill); fusing the
    # rotation drops them there, and attention reads the new keys from the cache.
    from kvfuse.passes.fuse_rope_cache_write import _attention_arg

    def step_kv(graph):
        return [_attention_arg(n, "key") is not None
                for n in graph.nodes if n.target is torch.ops.kvfuse.paged_attention.default]

    assert step_kv(snap.graphs_before[0]) == [True, False, False]
    assert step_kv(snap.graphs_after[0]) == [False, False, False]
    assert "the attention reads this step's keys from the cache" in be.report[0].reason
    assert not any("reads this step's keys" in r.reason for r in be.report[1:])


def test_dynamic_token_count():
    """With a symbolic token count the views the pass builds stay symbolic: one graph serves
    13 and 11 tokens, bit-exact with the unfused graph for both."""
    model = RopeModel(("hf_neox", "demo"), [KVCacheConfig(kv_cache_dtype="fp8")] * 2, seed=11)
    be = snapshot_backend()
    base = kvfuse.make_backend(fuse=False, force_disable_caches=True)
    torch._dynamo.reset()
    fused_fn = torch.compile(model, backend=be, dynamic=True)
    base_fn = torch.compile(model, backend=base, dynamic=True)
    for T in (13, 11):  # both fill two pages: only the token count changes
        x, md, positions = _inputs(T, 32, seed=T)
        caches, ref_caches = _caches(model), _caches(model)
        with torch.no_grad():
            out = fused_fn(x, caches, md, positions)
            ref_out = base_fn(x, ref_caches, md, positions)
        for i, (c, r) in enumerate(zip(caches, ref_caches)):
            assert_bytes_equal(c, r, f"T={T} layer {i} cache")
        assert_bytes_equal(out, ref_out, f"T={T} output")
    assert be.pass_manager.after == [{"rope_encode_and_cache_write": 2, "paged_attention": 2}]
    assert all("rotary: fused" in r.reason for r in be.report)


class _KeyUsedTwice(RopeModel):
    """The rotated key is also read by other code: the rotation must stay."""

    def forward(self, x, caches, md, positions):
        from rope_models import apply_rotary_pos_emb

        T, hs = x.shape[0], self.head_size
        q, k, v = torch.mm(x, self.w_qkv[0]).split([HQ * hs, HKV * hs, HKV * hs], dim=-1)
        cos, sin = self._hf_cos_sin(positions, self.inv_freq, x.dtype)
        qh, kh = apply_rotary_pos_emb(q.view(1, T, HQ, hs).transpose(1, 2), k.view(1, T, HKV, hs).transpose(1, 2),
                                      cos, sin)
        k = kh.transpose(1, 2).reshape(T, HKV, hs)
        o = self.attn[0](qh.transpose(1, 2).reshape(T, HQ, hs), k, v.reshape(T, HKV, hs), caches[0], md)
        return torch.cat([o.reshape(T, -1), k.reshape(T, -1)], dim=-1)


def test_refused_rotation_stays_correct_and_says_why():
    model = _KeyUsedTwice(("hf_neox",), [KVCacheConfig(kv_cache_dtype="fp8")], seed=2)
    x, md, positions = _inputs(5, 32, seed=4)
    be = snapshot_backend()
    _assert_same_as_unfused(model, be, x, md, positions)
    assert be.pass_manager.after == [{"encode_and_cache_write": 1, "paged_attention": 1}]
    (record,) = be.report
    assert record.fused and "rotary: not fused: key: the rotated values" in record.reason
    assert "have other users" in record.reason


def test_fuse_false_reports_what_would_be_fused():
    model = RopeModel(("hf_gptj",), [KVCacheConfig(kv_cache_dtype="nvfp4")], seed=1)
    x, md, positions = _inputs(4, 32, seed=2)
    be = snapshot_backend(fuse=False)
    _run(model, be, x, md, positions)
    assert be.pass_manager.after == be.pass_manager.before
    (record,) = be.report
    assert not record.fused
    assert "rotary: fusion disabled; would fuse (GPT-J interleaved, rotary_dim=32" in record.reason


def test_fuse_rotary_false_leaves_the_rotation_and_says_so():
    """make_backend(fuse_rotary=False): each encode and write still fused in its layer's format, no
    rotation fused, each record saying what would have been; the same bytes as the unfused graph."""
    model = RopeModel(("hf_neox", "hf_gptj"), [KVCacheConfig(kv_cache_dtype="fp8"),
                                               KVCacheConfig(kv_cache_dtype="nvfp4")], seed=6)
    x, md, positions = _inputs(7, model.head_size, seed=8)
    be = snapshot_backend(fuse_rotary=False)
    _assert_same_as_unfused(model, be, x, md, positions)
    assert be.pass_manager.after == [{"encode_and_cache_write": 2, "paged_attention": 2}]
    assert [r.kv_quant_mode for r in be.report] == [KVQuantMode.FP8_E4M3, KVQuantMode.NVFP4]
    assert all(r.fused for r in be.report)
    neox, gptj = (r.reason for r in be.report)
    assert "rotary: not fused: switched off by fuse_rotary=False; would fuse (NeoX rotate-half" in neox
    assert "rotary: not fused: switched off by fuse_rotary=False; would fuse (GPT-J interleaved" in gptj
    fused = snapshot_backend()
    _run(model, fused, x, md, positions)
    assert fused.pass_manager.after == [{"rope_encode_and_cache_write": 2, "paged_attention": 2}]


@pytest.mark.parametrize("forced,refused", [("native", True), ("triton", False), ("reference", False), (None, False)])
def test_a_forced_cache_backend_without_the_op_keeps_the_rotation(forced, refused, monkeypatch):
    from kvfuse.passes import fuse_rope_cache_write

    if forced:
        monkeypatch.setenv("KVFUSE_CACHE_WRITE_BACKEND", forced)
    kvfuse.envs.reload()
    problem = fuse_rope_cache_write._backend_problem()
    if refused:
        assert problem == ("the cache backend is forced to 'native', whose rope_encode_and_cache_write takes only "
                           "some calls and would refuse the others")
    else:
        assert problem is None


@pytest.mark.gpu
@pytest.mark.parametrize("styles", [("hf_neox", "hf_gptj", "hf_partial", "demo", "hf_neox_f32", "hf_neox_cached")])
@pytest.mark.parametrize("dtype_name", ["auto", "fp8", "nvfp4"])
@pytest.mark.parametrize("T", [1, 64, 517])
def test_gpu_fused_equals_unfused_graph(styles, dtype_name, T):
    """On CUDA the unfused graph's rotation is an Inductor Triton kernel (with fp contraction):
    the fused op must reproduce its bytes. Layers are not chained: a fused bf16 layer's attention
    reads the step's keys from the cache (the paged kernel) where the unfused one reads them from
    the step (the new-token kernel), whose sums over several key tiles round differently, so a
    chained next layer would see other inputs (seen at 517 tokens). The outputs are compared
    within bf16 tolerance for that reason."""
    model = RopeModel(styles, [KVCacheConfig(kv_cache_dtype=dtype_name)] * len(styles), head_size=128,
                      seed=T, chain=False).cuda()
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, HQ * 128, generator=g).bfloat16().cuda()
    blocks = (T + 3 + BLOCK - 1) // BLOCK
    num_blocks = blocks + 4
    perm = torch.randperm(num_blocks, generator=g)[:blocks].to(torch.int32)
    positions = torch.arange(3, 3 + T)
    slots = perm[positions // BLOCK].long() * BLOCK + positions % BLOCK
    md = AttentionMetadata(slot_mapping=slots.cuda(), block_table=perm.unsqueeze(0).cuda(),
                           seq_lens=torch.tensor([T + 3], dtype=torch.int32).cuda(),
                           query_start_loc=torch.tensor([0, T], dtype=torch.int32).cuda())

    def run(be):
        caches = [allocate_kv_cache(a.spec, num_blocks, BLOCK, device="cuda") for a in model.attn]
        for c in caches:
            c.view(torch.uint8).fill_(SENTINEL)
            # The 3-token prefix is attended to but never written: zero bytes decode to zeros in
            # every format (sentinel keys of 1.5e16 made both graphs' outputs overflow).
            c.view(torch.uint8)[int(perm[0])].zero_()
        torch._dynamo.reset()
        with torch.no_grad():
            out = torch.compile(model, backend=be, fullgraph=True)(x, caches, md, positions.cuda() + 1000)
        return out, caches

    be = kvfuse.make_backend(force_disable_caches=True)
    out, caches = run(be)
    assert all("rotary: fused" in r.reason for r in be.report), [r.reason for r in be.report]
    ref_out, ref_caches = run(kvfuse.make_backend(fuse=False, force_disable_caches=True))
    for i, (c, r) in enumerate(zip(caches, ref_caches)):
        assert_bytes_equal(c.cpu(), r.cpu(), f"layer {i} cache")
    torch.testing.assert_close(out.float().cpu(), ref_out.float().cpu(), atol=2e-2, rtol=2e-2)
