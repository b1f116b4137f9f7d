"""The fusion pass through the real backend: counts, report, outputs and cache bytes, per mode."""

from __future__ import annotations

import pytest
import torch

import kvfuse
from kvfuse import KVCacheConfig, KVFormat, KVQuantMode
from kvfuse.ops import registry as backends
from kvfuse.passes._graph import CACHE_WRITE, FUSED_WRITE

from compile_util import (
    TinyModel,
    assert_bytes_equal,
    make_caches,
    make_inputs,
    nodes_of,
    snapshot_backend,
)


def _eager_reference(model, x, md, monkeypatch):
    """The eager model (fused op) on the pure-PyTorch reference backend: the oracle."""
    caches = make_caches(model)
    monkeypatch.setenv("KVFUSE_BACKEND", "reference")
    backends.clear_cache()
    try:
        with torch.no_grad():
            out = model(x, caches, md)
    finally:
        monkeypatch.delenv("KVFUSE_BACKEND")
        backends.clear_cache()
    return out, caches


def _compile_and_run(model, be, x, md):
    caches = make_caches(model)
    with torch.no_grad():
        out = torch.compile(model, backend=be, fullgraph=True)(x, caches, md)
    return out, caches


CASES = [
    # (kv_cache_dtype, expected mode, auto_functionalized v2?)
    ("auto", KVQuantMode.NONE, True),
    ("float16", KVQuantMode.NONE, True),
    ("fp8", KVQuantMode.FP8_E4M3, True),
    ("fp8_e5m2", KVQuantMode.FP8_E5M2, True),
    ("nvfp4", KVQuantMode.NVFP4, True),
    ("fp8", KVQuantMode.FP8_E4M3, False),
    ("nvfp4", KVQuantMode.NVFP4, False),
    ("fp8_per_token_head", KVQuantMode.FP8_PER_TOKEN_HEAD, True),
]


@pytest.mark.parametrize("dtype_name,mode,v2", CASES, ids=[f"{c[0]}-{'v2' if c[2] else 'v1'}" for c in CASES])
def test_every_mode_fuses_bit_exact(dtype_name, mode, v2, monkeypatch):
    torch._dynamo.reset()
    model = TinyModel(2, KVCacheConfig(kv_cache_dtype=dtype_name), seed=hash(dtype_name) % 100)
    x, md = make_inputs(T=7)
    be = snapshot_backend(enable_auto_functionalized_v2=v2)
    out, caches = _compile_and_run(model, be, x, md)

    snap = be.pass_manager
    assert snap.before == [{"encode_kv": 4, "cache_write": 2, "paged_attention": 2}]
    assert snap.after == [{"encode_and_cache_write": 2, "paged_attention": 2}]
    hop = "auto_functionalized_v2" if v2 else "auto_functionalized"
    fused_nodes = nodes_of(snap.graphs_after[0], FUSED_WRITE)
    assert [n.target.__name__ for n, _ in fused_nodes] == [hop, hop]
    assert [a["kv_quant_mode"] for _, a in fused_nodes] == [int(mode)] * 2
    assert [(r.layer_name, r.kv_quant_mode, r.fused) for r in be.report] == [
        ("model.layers.0.attn", mode, True), ("model.layers.1.attn", mode, True)]
    assert all("kvfuse::encode_kv -> encode_and_cache_write" in r.reason for r in be.report)

    ref_out, ref_caches = _eager_reference(model, x, md, monkeypatch)
    for i, (c, r) in enumerate(zip(caches, ref_caches)):
        assert c.dtype == model.attn[i].spec.kv_cache_torch_dtype
        assert_bytes_equal(c, r, f"layer {i} cache")
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)


def test_fuse_false_is_the_unfused_baseline(monkeypatch):
    torch._dynamo.reset()
    model = TinyModel(2, KVCacheConfig(kv_cache_dtype="fp8"))
    x, md = make_inputs(T=7)
    be = snapshot_backend(fuse=False)
    out, caches = _compile_and_run(model, be, x, md)
    assert be.pass_manager.after == be.pass_manager.before == [{"encode_kv": 4, "cache_write": 2,
                                                                 "paged_attention": 2}]
    assert [r.fused for r in be.report] == [False, False]
    assert all(r.reason.startswith("fusion disabled") and "would be fused" in r.reason for r in be.report)
    ref_out, ref_caches = _eager_reference(model, x, md, monkeypatch)
    for c, r in zip(caches, ref_caches):
        assert_bytes_equal(c, r, "unfused cache")


def test_mixed_per_layer_modes_skip_by_index_and_sliding_window(monkeypatch):
    torch._dynamo.reset()
    cfg = KVCacheConfig(kv_cache_dtype="fp8", skip_layers=("0", "sliding_window"))
    model = TinyModel(4, cfg, sliding_windows=[None, None, 4, None])
    expected = [KVQuantMode.NONE, KVQuantMode.FP8_E4M3, KVQuantMode.NONE, KVQuantMode.FP8_E4M3]
    assert [a.spec.kv_quant_mode for a in model.attn] == expected
    x, md = make_inputs(T=7)
    be = snapshot_backend()
    out, caches = _compile_and_run(model, be, x, md)

    assert [(r.layer_name, r.kv_quant_mode, r.fused) for r in be.report] == [
        (f"model.layers.{i}.attn", m, True) for i, m in enumerate(expected)]
    graph = be.pass_manager.graphs_after[0]
    writes = {a["layer_name"]: a["kv_quant_mode"] for _, a in nodes_of(graph, FUSED_WRITE)}
    assert writes == {f"model.layers.{i}.attn": int(m) for i, m in enumerate(expected)}
    # The skipped layers' attention reads their bf16 caches in mode NONE.
    for n, a in nodes_of(graph, torch.ops.kvfuse.paged_attention.default):
        i = int(a["layer_name"].split(".")[2])
        assert a["kv_quant_mode"] == int(expected[i])
        assert a["kv_cache"].meta["val"].dtype == (torch.bfloat16 if i in (0, 2) else torch.float8_e4m3fn)
    assert [c.dtype for c in caches] == [torch.bfloat16, torch.float8_e4m3fn] * 2

    ref_out, ref_caches = _eager_reference(model, x, md, monkeypatch)
    for i, (c, r) in enumerate(zip(caches, ref_caches)):
        assert_bytes_equal(c, r, f"layer {i}")
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)


def _top_level_args(call: str) -> list:
    body, depth, args, cur = call.split("(", 1)[1], 0, [], ""
    for ch in body:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return args + [cur.strip()]


@pytest.mark.parametrize("v2", [True, False], ids=["v2", "v1"])
def test_reinplaced_no_cache_copy_in_output_code(v2):
    """The fused write mutates the cache argument itself: no clone/copy of it anywhere."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = TinyModel(2, KVCacheConfig(kv_cache_dtype="nvfp4"))
    x, md = make_inputs(T=7)
    caches = make_caches(model)
    be = kvfuse.make_backend(force_disable_caches=True, enable_auto_functionalized_v2=v2)
    with torch.no_grad():
        _, codes = run_and_get_code(torch.compile(model, backend=be, fullgraph=True), x, caches, md)
    code = "\n".join(codes)
    calls = [line.strip() for line in code.splitlines() if "kvfuse.encode_and_cache_write.default(" in line]
    assert len(calls) == 2, code
    for call in calls:
        cache_arg = _top_level_args(call)[2]
        assert cache_arg.startswith("arg") and cache_arg.endswith("_1"), call  # a graph input, not a buffer
    assert "clone" not in code and "copy_" not in code, code
    assert "encode_kv" not in code and "kvfuse.cache_write" not in code


@pytest.mark.parametrize("dtype_name,mode", [("fp8", KVQuantMode.FP8_E4M3), ("nvfp4", KVQuantMode.NVFP4)])
def test_per_head_layer_beside_per_tensor_layer(dtype_name, mode, monkeypatch):
    """One layer with per-KV-head scales, one with per-tensor scales: both fuse, bit-exact, and each
    fused write and attention carries its own layer's scale shape."""
    from compile_util import D, HKV, HQ

    torch._dynamo.reset()
    model = TinyModel(2, KVCacheConfig(kv_cache_dtype=dtype_name), seed=3)
    model.attn[1] = kvfuse.PagedAttention(HQ, HKV, D, "model.layers.1.attn",
                                          config=KVCacheConfig(dtype_name, kv_scale_granularity="head"))
    divisor = 448.0 if mode is KVQuantMode.FP8_E4M3 else 448.0 * 6
    model.attn[0].set_scales(0.9 / divisor, 2.0 / divisor)
    model.attn[1].set_scales([0.3 / divisor, 4.0 / divisor], [1.5 / divisor, 0.2 / divisor])
    assert [tuple(a.k_scale.shape) for a in model.attn] == [(), (HKV,)]
    x, md = make_inputs(T=7)
    be = snapshot_backend()
    out, caches = _compile_and_run(model, be, x, md)

    assert [(r.layer_name, r.kv_quant_mode, r.fused) for r in be.report] == [
        ("model.layers.0.attn", mode, True), ("model.layers.1.attn", mode, True)]
    graph = be.pass_manager.graphs_after[0]
    shapes = {a["layer_name"]: tuple(a["k_scale"].meta["val"].shape) for _, a in nodes_of(graph, FUSED_WRITE)}
    assert shapes == {"model.layers.0.attn": (), "model.layers.1.attn": (HKV,)}
    ref_out, ref_caches = _eager_reference(model, x, md, monkeypatch)
    for i, (c, r) in enumerate(zip(caches, ref_caches)):
        assert_bytes_equal(c, r, f"layer {i} cache")
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    # The per-head scales matter: the same layer with its head-0 scales for both heads writes other bytes.
    model.attn[1].set_scales(float(model.attn[1].k_scale[0]), float(model.attn[1].v_scale[0]))
    _, flat_caches = _eager_reference(model, x, md, monkeypatch)
    assert not torch.equal(flat_caches[1].view(torch.uint8), caches[1].view(torch.uint8))


def test_per_token_head_layer_beside_per_tensor_fp8_and_bf16_skip_layers(monkeypatch):
    """fp8_per_token_head, per-tensor FP8 and a bf16 skip layer in one compiled graph: the two quantized
    writes fuse, each node carries its layer's mode, the report names them, caches are bit-exact."""
    from compile_util import D, HKV, HQ

    torch._dynamo.reset()
    model = TinyModel(3, KVCacheConfig(kv_cache_dtype="fp8_per_token_head", skip_layers=("2",)), seed=5)
    model.attn[1] = kvfuse.PagedAttention(HQ, HKV, D, "model.layers.1.attn", config=KVCacheConfig("fp8"))
    model.attn[1].set_scales(0.02, 0.01)
    expected = [KVQuantMode.FP8_PER_TOKEN_HEAD, KVQuantMode.FP8_E4M3, KVQuantMode.NONE]
    assert [a.spec.kv_quant_mode for a in model.attn] == expected
    x, md = make_inputs(T=7)
    be = snapshot_backend()
    out, caches = _compile_and_run(model, be, x, md)

    assert [(r.layer_name, r.kv_quant_mode, r.fused) for r in be.report] == [
        (f"model.layers.{i}.attn", m, True) for i, m in enumerate(expected)]
    assert be.pass_manager.after == [{"encode_and_cache_write": 3, "paged_attention": 3}]
    graph = be.pass_manager.graphs_after[0]
    writes = {a["layer_name"]: a["kv_quant_mode"] for _, a in nodes_of(graph, FUSED_WRITE)}
    assert writes == {f"model.layers.{i}.attn": int(m) for i, m in enumerate(expected)}
    reads = {a["layer_name"]: (a["kv_quant_mode"], a["kv_cache"].meta["val"].dtype)
             for _, a in nodes_of(graph, torch.ops.kvfuse.paged_attention.default)}
    assert reads == {"model.layers.0.attn": (int(expected[0]), torch.uint8),
                     "model.layers.1.attn": (int(expected[1]), torch.float8_e4m3fn),
                     "model.layers.2.attn": (int(expected[2]), torch.bfloat16)}
    ref_out, ref_caches = _eager_reference(model, x, md, monkeypatch)
    for i, (c, r) in enumerate(zip(caches, ref_caches)):
        assert_bytes_equal(c, r, f"layer {i} cache")
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)


def test_mixed_kv_formats_beside_uniform_and_skip_layers(monkeypatch):
    """Layers whose K and V formats differ (FP8 K / NVFP4 V, bf16 K / FP8 V) beside a uniform FP8 layer
    and a bf16 skip layer, in one graph: each side is encoded in its own mode before the pass, every
    write fuses into one op carrying the layer's format code, the report names both sides, and the
    caches equal the eager reference byte for byte."""
    from compile_util import D, HKV, HQ

    torch._dynamo.reset()
    mixed = KVCacheConfig(k_cache_dtype="fp8", v_cache_dtype="nvfp4", skip_layers=("3",))
    model = TinyModel(4, mixed, seed=11)
    model.attn[1] = kvfuse.PagedAttention(HQ, HKV, D, "model.layers.1.attn",
                                          config=KVCacheConfig(v_cache_dtype="fp8"))
    model.attn[2] = kvfuse.PagedAttention(HQ, HKV, D, "model.layers.2.attn", config=KVCacheConfig("fp8"))
    for attn in model.attn:
        attn.set_scales(0.02, 0.01)
    formats = [KVFormat(KVQuantMode.FP8_E4M3, KVQuantMode.NVFP4), KVFormat(KVQuantMode.NONE, KVQuantMode.FP8_E4M3),
               KVFormat(KVQuantMode.FP8_E4M3, KVQuantMode.FP8_E4M3), KVFormat(KVQuantMode.NONE, KVQuantMode.NONE)]
    assert [a.spec.kv_format for a in model.attn] == formats
    x, md = make_inputs(T=7)
    be = snapshot_backend()
    out, caches = _compile_and_run(model, be, x, md)

    before = be.pass_manager.graphs_before[0]
    encoded = {}
    for _, a in nodes_of(before, torch.ops.kvfuse.encode_kv.default):
        encoded.setdefault(a["layer_name"], []).append((a["kv_quant_mode"], a["cache_dtype"]))
    assert encoded["model.layers.0.attn"] == [(int(KVQuantMode.FP8_E4M3), torch.float8_e4m3fn),
                                              (int(KVQuantMode.NVFP4), torch.uint8)]
    assert encoded["model.layers.1.attn"] == [(int(KVQuantMode.NONE), torch.bfloat16),
                                              (int(KVQuantMode.FP8_E4M3), torch.float8_e4m3fn)]
    assert be.pass_manager.after == [{"encode_and_cache_write": 4, "paged_attention": 4}]
    graph = be.pass_manager.graphs_after[0]
    writes = {a["layer_name"]: a["kv_quant_mode"] for _, a in nodes_of(graph, FUSED_WRITE)}
    assert writes == {f"model.layers.{i}.attn": f.code for i, f in enumerate(formats)}
    assert writes["model.layers.0.attn"] == 0o113
    reads = {a["layer_name"]: a["kv_quant_mode"] for _, a in nodes_of(graph, torch.ops.kvfuse.paged_attention.default)}
    assert reads == writes
    expected_modes = [formats[0], formats[1], KVQuantMode.FP8_E4M3, KVQuantMode.NONE]
    assert [(r.layer_name, r.kv_quant_mode, r.fused) for r in be.report] == [
        (f"model.layers.{i}.attn", m, True) for i, m in enumerate(expected_modes)]
    assert [r.as_dict()["kv_quant_mode"] for r in be.report][:2] == ["FP8_E4M3/NVFP4", "NONE/FP8_E4M3"]
    assert [c.dtype for c in caches] == [torch.uint8, torch.uint8, torch.float8_e4m3fn, torch.bfloat16]

    ref_out, ref_caches = _eager_reference(model, x, md, monkeypatch)
    for i, (c, r) in enumerate(zip(caches, ref_caches)):
        assert_bytes_equal(c, r, f"layer {i} cache")
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
