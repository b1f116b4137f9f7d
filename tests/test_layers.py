"""PagedAttention: eager == the ops by hand, the compiled graph is unfused, skip layers stay bf16."""

import pytest
import torch

import kvfuse
from kvfuse import AttentionMetadata, KVCacheConfig, KVQuantMode, PagedAttention, allocate_kv_cache


pytestmark = pytest.mark.usefixtures("reference_backend")


def _inputs(num_heads, num_kv_heads, head_size, q_lens, seed=0, pad=2):
    g = torch.Generator().manual_seed(seed)
    t = sum(q_lens) + pad
    q = torch.randn(t, num_heads, head_size, generator=g).bfloat16()
    k = (torch.randn(t, num_kv_heads, head_size, generator=g) * 3).bfloat16()
    v = torch.randn(t, num_kv_heads, head_size, generator=g).bfloat16()
    return q, k, v


def _prefill_metadata(q_lens, block_size, pad=2):
    """Prefill of fresh sequences; sequence b owns pages [b * n, (b + 1) * n) in reverse order."""
    blocks = max(-(-n // block_size) for n in q_lens)
    table = torch.zeros(len(q_lens), blocks, dtype=torch.int32)
    slots, qsl = [], [0]
    for b, n in enumerate(q_lens):
        pages = list(range((b + 1) * blocks - 1, b * blocks - 1, -1))
        table[b] = torch.tensor(pages, dtype=torch.int32)
        slots += [pages[p // block_size] * block_size + p % block_size for p in range(n)]
        qsl.append(qsl[-1] + n)
    slots += [-1] * pad
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_table=table,
        seq_lens=torch.tensor(q_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
    ), len(q_lens) * blocks


@pytest.mark.parametrize("dtype_name", ["auto", "float16", "fp8", "fp8_e5m2", "nvfp4"])
def test_eager_equals_the_ops_by_hand(dtype_name):
    heads, kv_heads, head_size, block_size = 4, 2, 64, 4
    q_lens = [7, 3]
    attn = PagedAttention(heads, kv_heads, head_size, "model.layers.5.attn", config=KVCacheConfig(dtype_name),
                          sliding_window=5)
    attn.set_scales(0.5, 2.0)
    q, k, v = _inputs(heads, kv_heads, head_size, q_lens)
    md, num_blocks = _prefill_metadata(q_lens, block_size)
    cache = allocate_kv_cache(attn.spec, num_blocks + 1, block_size)
    cache.view(torch.uint8).fill_(0x11)
    manual_cache = cache.clone()

    out = attn(q, k, v, cache, md)

    mode, dtype = attn.spec.kv_quant_mode, attn.spec.kv_cache_torch_dtype
    k_rows = kvfuse.ops.encode_kv(k, torch.tensor(0.5), mode, dtype)
    v_rows = kvfuse.ops.encode_kv(v, torch.tensor(2.0), mode, dtype)
    kvfuse.ops.cache_write(k_rows, v_rows, manual_cache, md.slot_mapping, mode)
    expected = kvfuse.ops.paged_attention(q, manual_cache, torch.tensor(0.5), torch.tensor(2.0), md.block_table,
                                          md.seq_lens, md.query_start_loc, mode, head_size ** -0.5, 5)
    assert torch.equal(cache.view(torch.uint8), manual_cache.view(torch.uint8))
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.equal(out, expected)
    assert (out[sum(q_lens):] == 0).all()
    assert (cache[num_blocks].view(torch.uint8) == 0x11).all(), "the spare page was written"


def test_layer_refuses_a_cache_of_another_spec():
    attn = PagedAttention(4, 2, 64, "model.layers.1.attn", config=KVCacheConfig("fp8"))
    q, k, v = _inputs(4, 2, 64, [3])
    md, num_blocks = _prefill_metadata([3], 4)
    bf16_spec = KVCacheConfig().layer_spec("model.layers.1.attn", 2, 64)
    wrong = allocate_kv_cache(bf16_spec, num_blocks, 4)
    with pytest.raises(ValueError, match=r"model.layers.1.attn.*torch.bfloat16.*needs torch.float8_e4m3fn.*"
                                         r"allocate_kv_cache"):
        attn(q, k, v, wrong, md)
    assert not wrong.any()


def test_skip_layer_stays_in_model_dtype_in_a_mixed_model():
    # vLLM PR 39002: a skipped (bf16) layer was treated as FP8 because a global dtype was read.
    cfg = KVCacheConfig("fp8", skip_layers=("0", "sliding_window"))
    layers = [
        PagedAttention(4, 2, 64, "model.layers.0.attn", config=cfg),
        PagedAttention(4, 2, 64, "model.layers.1.attn", config=cfg),
        PagedAttention(4, 2, 64, "model.layers.2.attn", config=cfg, sliding_window=4),
    ]
    assert [a.spec.kv_quant_mode for a in layers] == [KVQuantMode.NONE, KVQuantMode.FP8_E4M3, KVQuantMode.NONE]
    q, k, v = _inputs(4, 2, 64, [6])
    md, num_blocks = _prefill_metadata([6], 4)
    caches = [allocate_kv_cache(a.spec, num_blocks, 4) for a in layers]
    assert [c.dtype for c in caches] == [torch.bfloat16, torch.float8_e4m3fn, torch.bfloat16]
    outs = [a(q, k, v, c, md) for a, c in zip(layers, caches)]
    slots = md.slot_mapping[:6]
    for i in (0, 2):  # skip layers hold the exact bf16 keys and values
        flat = caches[i].transpose(1, 2).reshape(-1, 2, 2, 64)
        assert torch.equal(flat[slots, 0], k[:6]) and torch.equal(flat[slots, 1], v[:6])
    flat = caches[1].transpose(1, 2).reshape(-1, 2, 2, 64)
    assert torch.equal(flat[slots, 0].float(), k[:6].float().to(torch.float8_e4m3fn).float())
    assert not torch.equal(outs[0], outs[1])  # FP8 rounding shows
    rel = (outs[0].float() - outs[1].float()).norm() / outs[0].float().norm()
    assert rel < 0.05, rel


def test_scale_buffers():
    attn = PagedAttention(4, 2, 64, "model.layers.0.attn", config=KVCacheConfig("fp8"))
    for name in ("k_scale", "v_scale"):
        buf = getattr(attn, name)
        assert buf.dtype == torch.float32 and buf.shape == () and buf.item() == 1.0
        assert name in dict(attn.named_buffers()) and name in attn.state_dict()
    attn.set_scales(0.25, 4.0)
    assert (attn.k_scale.item(), attn.v_scale.item()) == (0.25, 4.0)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"model.layers.0.attn.*k_scale="):
            attn.set_scales(bad, 1.0)
    # Casting the module (model.to(bf16), .half()) must not cast the scales: the ops need float32.
    attn.to(torch.bfloat16)
    attn.half()
    assert attn.k_scale.dtype == torch.float32 and attn.k_scale.item() == 0.25
    # The scale really divides: k = 2 * k_scale is stored as 2.
    q, k, v = _inputs(4, 2, 64, [1], pad=0)
    k = torch.full_like(k, 0.5)
    md, num_blocks = _prefill_metadata([1], 4, pad=0)
    cache = allocate_kv_cache(attn.spec, num_blocks, 4)
    attn(q, k, v, cache, md)
    assert (cache[md.slot_mapping[0] // 4, 0, md.slot_mapping[0] % 4].float() == 2.0).all()


def test_constructor_validation():
    with pytest.raises(ValueError, match="num_kv_heads=3 must be a positive int dividing num_heads=4"):
        PagedAttention(4, 3, 64, "model.layers.0.attn")
    with pytest.raises(ValueError, match="num_heads=0"):
        PagedAttention(0, 1, 64, "model.layers.0.attn")
    with pytest.raises(ValueError, match="head_size=72 .*multiple of 16"):
        PagedAttention(4, 2, 72, "model.layers.0.attn", config=KVCacheConfig("nvfp4"))


def _recording_inductor(seen):
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return compile_fx(gm, example_inputs)

    return backend


@pytest.mark.parametrize("dtype_name", ["fp8", "auto"])
def test_compiled_layer_emits_unfused_ops_and_matches_eager(dtype_name):
    torch._dynamo.reset()
    heads, kv_heads, head_size, block_size = 2, 1, 32, 4
    q_lens = [5, 2]
    attn = PagedAttention(heads, kv_heads, head_size, "model.layers.3.attn", config=KVCacheConfig(dtype_name))
    attn.set_scales(0.5, 0.75)
    q, k, v = _inputs(heads, kv_heads, head_size, q_lens, seed=4)
    md, num_blocks = _prefill_metadata(q_lens, block_size)
    eager_cache = allocate_kv_cache(attn.spec, num_blocks, block_size)
    compiled_cache = eager_cache.clone()
    seen = []
    compiled = torch.compile(attn, backend=_recording_inductor(seen), fullgraph=True)
    out = compiled(q, k, v, compiled_cache, md)
    expected = attn(q, k, v, eager_cache, md)
    kvfuse_ops = [t for t in seen if "kvfuse" in t]
    assert sum("encode_kv" in t for t in kvfuse_ops) == 2, kvfuse_ops
    assert sum("cache_write" in t and "encode_and" not in t for t in kvfuse_ops) == 1, kvfuse_ops
    assert not any("encode_and_cache_write" in t for t in kvfuse_ops), kvfuse_ops
    assert sum("paged_attention" in t for t in kvfuse_ops) == 1, kvfuse_ops
    assert torch.equal(compiled_cache.view(torch.uint8), eager_cache.view(torch.uint8))
    assert torch.equal(out, expected)


@pytest.mark.parametrize("which,bad,allowed", [
    ("kv_cache", "list", "not the list of every layer's caches"),
    ("metadata", "dict", "kvfuse.AttentionMetadata(**your_dict)"),
    ("query", "list", "expected a torch.Tensor [num_tokens, heads, head_size]"),
])
def test_wrong_argument_types_name_the_argument(which, bad, allowed):
    attn = PagedAttention(4, 2, 16, "model.layers.0.attn", config=KVCacheConfig("fp8"))
    q, k, v = _inputs(4, 2, 16, [3])
    md, blocks = _prefill_metadata([3], 4)
    cache = allocate_kv_cache(attn.spec, blocks, 4)
    args = {"query": q, "key": k, "value": v, "kv_cache": cache, "metadata": md}
    before = cache.clone()
    if bad == "list":
        args[which] = [args[which]]
    else:
        args[which] = {f: getattr(md, f) for f in ("slot_mapping", "block_table", "seq_lens", "query_start_loc")}
    with pytest.raises(ValueError) as info:
        attn(**args)
    message = str(info.value)
    assert message.startswith("layer 'model.layers.0.attn': ") and f"{which} is a {bad}" in message, message
    assert allowed in message, message
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


def test_model_dtype_string_and_check_skip_rules(caplog):
    from kvfuse.layers import check_skip_rules

    cfg = KVCacheConfig("fp8", skip_layers=("0", "9"))
    layers = torch.nn.ModuleList(PagedAttention(4, 2, 16, f"model.layers.{i}.attn", config=cfg, model_dtype="half")
                                 for i in range(2))
    assert [a.spec.kv_cache_torch_dtype for a in layers] == [torch.float16, torch.float8_e4m3fn]
    with caplog.at_level("WARNING", logger="kvfuse.kv_cache"):
        assert check_skip_rules(layers) == ("9",)
    assert "'9' matches no layer" in caplog.text
    with pytest.raises(ValueError, match="'9' matches no layer"):
        check_skip_rules(layers, strict=True)
    with pytest.raises(ValueError, match="model_dtype='int8' must name a native dtype"):
        PagedAttention(4, 2, 16, "model.layers.0.attn", model_dtype="int8")


def test_grad_mode_gives_no_autograd_warning_and_no_grad_output():
    import warnings

    attn = PagedAttention(4, 2, 16, "model.layers.0.attn", config=KVCacheConfig("fp8"))
    q, k, v = (t.requires_grad_() for t in _inputs(4, 2, 16, [3]))
    md, blocks = _prefill_metadata([3], 4)
    cache = allocate_kv_cache(attn.spec, blocks, 4)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*autograd kernel was not registered.*")
        out = attn(q, k, v, cache, md)
    # The kernels are not differentiable: a result that claims a gradient would be silently wrong.
    assert not out.requires_grad


def _bad_head_count_case():
    attn = PagedAttention(4, 2, 32, "model.layers.0.attn", KVCacheConfig("fp8"))
    cache = allocate_kv_cache(attn.spec, 8, 16)
    md = AttentionMetadata(torch.arange(5), torch.tensor([[0]], dtype=torch.int32),
                           torch.tensor([5], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32))
    q = torch.randn(5, 4, 32).bfloat16()
    k = torch.randn(5, 3, 32).bfloat16()  # 3 KV heads for a 2-head layer
    return attn, cache, md, q, k


@pytest.mark.parametrize("fullgraph", [False, True])
def test_wrong_head_count_under_compile_names_the_users_argument(fullgraph):
    """Issue 19, item 9: the error names `key` and what the layer takes, never the op's internal `key_rows`."""
    attn, cache, md, q, k = _bad_head_count_case()
    before = cache.clone()
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(attn, backend=kvfuse.make_backend(), fullgraph=fullgraph)(q, k, k, cache, md)
    text = str(info.value)
    assert "key has shape (5, 3, 32); this layer takes [num_tokens, 2, 32]" in text and "key_rows" not in text
    if not fullgraph:  # Dynamo falls back to eager: the layer's own ValueError, as in eager
        assert isinstance(info.value, ValueError)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("name", ["query", "key", "value"])
def test_a_tensor_in_another_dtype_than_the_model_is_refused(name):
    """Issue 19, item 5: a float16 query (or key, value) with a bf16 layer is refused, not silently computed."""
    attn, cache, md, q, _ = _bad_head_count_case()
    args = {"query": q, "key": torch.randn(5, 2, 32).bfloat16(), "value": torch.randn(5, 2, 32).bfloat16()}
    args[name] = args[name].half()
    with pytest.raises(ValueError, match=rf"{name}.dtype=torch.float16, but this layer's model dtype is torch.bfloat16"):
        attn(args["query"], args["key"], args["value"], cache, md)
