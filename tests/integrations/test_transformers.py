"""transformers models on kvfuse caches vs transformers' own eager runs (tiny random models, CPU)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

pytest.importorskip("transformers")

import kvfuse  # noqa: E402
from kvfuse.integrations import transformers as kvt  # noqa: E402
from kvfuse.kv_cache import KVQuantMode  # noqa: E402

from _hf_models import (build, greedy_tokens, left_padded_batch, rotary_fusion_reasons,  # noqa: E402
                        teacher_forced_logits)

MODELS = ["llama", "qwen3", "mistral", "gemma2", "gemma3", "gpt_oss"]
GEN = dict(max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)


def expected_windows(model):
    """Each layer's window as transformers' eager attention applies it (from the config)."""
    cfg = model.config
    if getattr(cfg, "layer_types", None) is not None and type(model).__name__ != "MistralForCausalLM":
        return [cfg.sliding_window if t == "sliding_attention" else None for t in cfg.layer_types]
    return [getattr(cfg, "sliding_window", None)] * cfg.num_hidden_layers


def generate_both(name, kv_config, dtype=torch.float32, lengths=(9, 4, 6)):
    ref = build(name, dtype)
    model = kvt.enable(copy.deepcopy(ref), kv_config)
    ids, mask = left_padded_batch(lengths)
    want = ref.generate(input_ids=ids, attention_mask=mask, **GEN)
    got = model.generate(input_ids=ids, attention_mask=mask, **GEN)
    return ref, model, want, got


def max_score_diff(a, b, steps=None):
    pairs = list(zip(a.scores, b.scores))[:steps]
    return max((x.float() - y.float()).abs().max().item() for x, y in pairs)


# ----------------------------------------------------------------------------- float32, cache "auto"


@pytest.mark.parametrize("name", MODELS)
def test_generate_matches_transformers_eager(name):
    ref, model, want, got = generate_both(name, kvfuse.KVCacheConfig())
    assert isinstance(got.past_key_values, kvt.KVFuseCache)
    assert got.sequences.shape[1] == 9 + 12
    assert torch.equal(got.sequences, want.sequences)
    assert max_score_diff(want, got) < 2e-5
    layers = kvt.kvfuse_layers(model)
    assert [layer.spec.layer_index for layer in layers] == list(range(ref.config.num_hidden_layers))
    assert [layer.spec.sliding_window for layer in layers] == expected_windows(ref)
    for layer, module in zip(layers, [m for _, m in kvt._attention_modules(model)]):
        assert layer.spec.kv_quant_mode is KVQuantMode.NONE and layer.spec.kv_cache_torch_dtype == torch.float32
        assert layer.sm_scale == module.scaling and layer.spec.head_size == module.head_dim
        assert layer.spec.num_kv_heads == ref.config.num_key_value_heads


@pytest.mark.parametrize("name,feature", [("gemma2", "softcap"), ("gpt_oss", "sinks"), ("mistral", "window"),
                                          ("gemma3", "window")])
def test_each_feature_changes_transformers_output(name, feature):
    """The comparisons above would miss a dropped feature only if it did not matter: it does."""
    ref = build(name)
    ids, mask = left_padded_batch()
    base = ref(input_ids=ids, attention_mask=mask).logits
    off = copy.deepcopy(ref)
    if feature == "softcap":
        off.config.attn_logit_softcapping = None
        for layer in off.model.layers:
            layer.self_attn.attn_logit_softcapping = None
    elif feature == "sinks":
        for layer in off.model.layers:
            layer.self_attn.sinks.data.fill_(-1e4)
    else:
        off.config.sliding_window = 10**6
        for layer in off.model.layers:
            if getattr(layer.self_attn, "sliding_window", None):
                layer.self_attn.sliding_window = 10**6
    diff = (off(input_ids=ids, attention_mask=mask).logits - base)[mask.bool()].abs().max().item()
    assert diff > 1e-3, f"{feature} does not change {name}'s logits ({diff})"


def test_model_and_plain_forward_with_right_padding():
    ref = build("llama")
    model = kvt.enable(copy.deepcopy(ref), kvfuse.KVCacheConfig())
    ids, mask = left_padded_batch((3, 8, 5), seed=4)
    # Right padding: move every prompt to the left edge.
    for b in range(ids.shape[0]):
        n = int(mask[b].sum())
        ids[b] = torch.cat([ids[b, -n:], torch.zeros(ids.shape[1] - n, dtype=torch.long)])
        mask[b] = torch.cat([torch.ones(n), torch.zeros(ids.shape[1] - n)]).long()
    out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    want = ref(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(out.logits[real], want[real], atol=2e-5, rtol=2e-5)
    cache = out.past_key_values
    assert isinstance(cache, kvt.KVFuseCache)
    assert [cache.manager.seq_len(b) for b in range(3)] == [3, 8, 5]  # padding never cached
    # One decode step per row at its own next position, against a full forward of the real tokens.
    nxt = torch.tensor([[7], [8], [9]])
    step = model(input_ids=nxt, attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1),
                 past_key_values=cache, position_ids=mask.sum(1, keepdim=True))
    for b in range(3):
        n = int(mask[b].sum())
        full = ref(input_ids=torch.cat([ids[b, :n], nxt[b]])[None]).logits[0, -1]
        torch.testing.assert_close(step.logits[b, -1], full, atol=2e-5, rtol=2e-5)


def test_rows_released_early_and_pool_growth():
    ref = build("gpt_oss")
    model = kvt.enable(copy.deepcopy(ref), kvfuse.KVCacheConfig())
    ids, mask = left_padded_batch((5, 2, 7), seed=6)
    # A pool of one 2-token page: every step below must grow it, keeping what is cached.
    cache = kvt.KVFuseCache(model, max_seq_len=2, num_blocks=1, block_size=2)
    # Left padding: position ids from the mask, as generate() makes them.
    out = model(input_ids=ids, attention_mask=mask, past_key_values=cache,
                position_ids=(mask.cumsum(1) - 1).clamp(min=0))
    seqs = [ids[b][mask[b].bool()].tolist() for b in range(3)]
    pos = mask.sum(1, keepdim=True)
    free_before = None
    for step in range(5):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        new_mask = torch.ones(3, 1, dtype=torch.long)
        if step >= 2:  # row 1 finished after two tokens: its pages go back, it is masked out
            if step == 2:
                free_before = cache.manager.num_free_blocks
                cache.release([1])
                assert cache.manager.num_free_blocks > free_before
            new_mask[1] = 0
        mask = torch.cat([mask, new_mask], 1)
        for b in range(3):
            if new_mask[b]:
                seqs[b].append(int(nxt[b]))
        out = model(input_ids=nxt, attention_mask=mask, past_key_values=cache, position_ids=pos)
        pos = pos + 1
        for b in (0, 2):
            full = ref(input_ids=torch.tensor([seqs[b]])).logits[0, -1]
            torch.testing.assert_close(out.logits[b, -1], full, atol=2e-5, rtol=2e-5)
    assert cache.manager.num_blocks > 1 and cache.manager.max_seq_len >= len(seqs[2])
    with pytest.raises(ValueError, match="row 1 was released"):
        model(input_ids=nxt, attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1),
              past_key_values=cache)


# ----------------------------------------------------------------------------- bf16, FP8, NVFP4




@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss"])
def test_bf16_model_with_bf16_cache_within_bound(name):
    # Both runs get the same tokens (transformers' greedy ones), so a flipped near-tie argmax
    # cannot hide a difference. Stated bound: every logit of every step within 3% of the
    # logits' range of transformers' bf16 eager run (transformers rounds scores, probabilities
    # and outputs to bf16; kvfuse accumulates in float32).
    ref = build(name, torch.bfloat16)
    model = kvt.enable(copy.deepcopy(ref), kvfuse.KVCacheConfig())
    assert kvt.kvfuse_layers(model)[0].spec.kv_cache_torch_dtype == torch.bfloat16
    ids, mask = left_padded_batch()
    tokens = greedy_tokens(ref, ids, mask)
    want = teacher_forced_logits(ref, ids, mask, tokens)
    got = teacher_forced_logits(model, ids, mask, tokens)
    err = (got - want).abs().max().item()
    assert err < 0.03 * want.abs().max().item(), err


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss", "llama"])
def test_fp8_cache_with_sliding_layers_skipped(name):
    fp8 = kvfuse.KVCacheConfig(kv_cache_dtype="fp8", skip_layers=("sliding_window",))
    ref = build(name)
    model = kvt.enable(copy.deepcopy(ref), fp8)
    windows = expected_windows(ref)
    layers = kvt.kvfuse_layers(model)
    for layer, window in zip(layers, windows):
        if window is None:
            assert layer.spec.kv_quant_mode is KVQuantMode.FP8_E4M3 and "explicit" in layer.spec.reason
        else:
            assert layer.spec.kv_quant_mode is KVQuantMode.NONE and "sliding_window" in layer.spec.reason
    # Same weights with a bf16 cache (explicit native dtype): the FP8 run stays within the bound.
    bf16 = kvt.enable(copy.deepcopy(ref), kvfuse.KVCacheConfig(kv_cache_dtype="bfloat16"))
    ids, mask = left_padded_batch()
    a = bf16(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    b = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    # Stated bound: 10% of the logits' range (e4m3 keeps 3 mantissa bits: up to 6% relative
    # error per cached element; measured 2.5-5%).
    err = (a - b).abs().max().item()
    assert err < 0.1 * a.abs().max().item(), (name, err)
    if all(w is not None for w in windows):
        assert err == 0


def test_nvfp4_cache_runs_within_bound():
    ref = build("llama")  # head_dim 16: one NVFP4 block per row
    model = kvt.enable(copy.deepcopy(ref), kvfuse.KVCacheConfig(kv_cache_dtype="nvfp4", skip_layers=("0",)))
    modes = [layer.spec.kv_quant_mode for layer in kvt.kvfuse_layers(model)]
    assert modes == [KVQuantMode.NONE, KVQuantMode.NVFP4]
    assert kvt.kvfuse_layers(model)[1].spec.row_dim == 16 // 2 + 16 // 16
    ids, mask = left_padded_batch()
    want = ref(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    got = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    # Stated bound: 15% of the logits' range (E2M1 keeps 1 mantissa bit, one scale per 16 values).
    err = (got - want).abs().max().item()
    assert 0 < err < 0.15 * want.abs().max().item()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (3, 13)


# ----------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_compiled_generate_same_tokens_and_report(name):
    # Compiles only the two models that carry the new attention features (each compile costs
    # ~15-30 s on a CPU): soft-capping + windows, and sinks + windows + MoE.
    cfg = kvfuse.KVCacheConfig(kv_cache_dtype="fp8", skip_layers=("sliding_window",))
    ref = build(name)
    model = kvt.enable(copy.deepcopy(ref), cfg)
    ids, mask = left_padded_batch()
    eager = model.generate(input_ids=ids, attention_mask=mask, **GEN)
    be = kvfuse.make_backend()
    model.forward = torch.compile(model.forward, backend=be)
    compiled = model.generate(input_ids=ids, attention_mask=mask, **GEN)
    assert torch.equal(compiled.sequences, eager.sequences)
    assert max_score_diff(eager, compiled) < 1e-4
    layers = kvt.kvfuse_layers(model)
    assert [r.layer_name for r in be.report] == [layer.layer_name for layer in layers]
    assert [r.kv_quant_mode for r in be.report] == [layer.spec.kv_quant_mode for layer in layers]
    assert {r.kv_quant_mode for r in be.report} == {KVQuantMode.NONE, KVQuantMode.FP8_E4M3}
    assert all(r.fused for r in be.report)


@pytest.mark.parametrize("name,dtype,want", [
    ("llama", torch.bfloat16, "fused into rope_encode_and_cache_write (NeoX rotate-half, rotary_dim=16, half-width "
                              "(the graph's tables repeat each column"),
    ("gpt_oss", torch.bfloat16, "fused into rope_encode_and_cache_write (NeoX (demo chunk form), rotary_dim=16, "
                                "half-width"),
    ("qwen3", torch.bfloat16, "not fused: the input is computed by"),
    ("qwen3", torch.float32, "fused into rope_encode_and_cache_write (NeoX rotate-half"),
])
def test_compiled_rotary_fusion_equals_the_unfused_graph(name, dtype, want):
    """Each layer's rotation fused into its write, under left padding (rows the integration packs
    by index) and in the decode steps (batch 3, one token each): the same tokens, scores and cache
    bytes as the graph compiled without fusion. gpt_oss: the chunk form, with sinks and windows.
    qwen3's QK-norm runs inside Inductor's rotation kernel unrounded, which the fused op cannot
    reproduce bit for bit in bf16, so the pass leaves it (and says why); in float32 nothing is
    rounded apart, and it fuses."""
    ids, mask = left_padded_batch()
    reasons = rotary_fusion_reasons(build(name, dtype), ids, mask, kvfuse.KVCacheConfig(kv_cache_dtype="fp8"))
    assert all(("rotary: " + want) in r and ("with the query" in r or "not fused" in want) for r in reasons), reasons


def test_compiled_module_decode_with_prepared_steps():
    ref = build("llama")
    model = kvt.enable(copy.deepcopy(ref), kvfuse.KVCacheConfig(kv_cache_dtype="fp8"))
    ids, mask = left_padded_batch()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        eager_cache = copy.deepcopy(out.past_key_values)
        cache = out.past_key_values
        be = kvfuse.make_backend()
        compiled = torch.compile(model, backend=be)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        pos = mask.sum(1, keepdim=True)
        for _ in range(3):
            mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
            want = model(input_ids=nxt, attention_mask=mask, past_key_values=eager_cache, position_ids=pos).logits
            step = cache.prepare_step(mask, 3, 1)
            got = compiled(input_ids=nxt, past_key_values=cache, position_ids=pos, kvfuse_step=step).logits
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            nxt, pos = want[:, -1].argmax(-1, keepdim=True), pos + 1
    assert [r.fused for r in be.report] == [True, True]
    assert all(r.kv_quant_mode is KVQuantMode.FP8_E4M3 for r in be.report)


# ----------------------------------------------------------------------------- checkpoints and errors


def test_checkpoint_scheme_and_scales(tmp_path):
    from safetensors.torch import save_file

    ref = build("llama")
    ref.save_pretrained(tmp_path)
    # Scales under the three conventions: compressed-tensors (layer 0), ModelOpt (layer 1).
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
               "model.layers.0.self_attn.v_scale": torch.tensor(0.25),
               "model.layers.1.self_attn.k_proj.k_scale": torch.tensor([2.0]),
               "model.layers.1.self_attn.v_proj.v_scale": torch.tensor([4.0])},
              os.path.join(tmp_path, "kv_scales.safetensors"))
    import transformers as tf

    model = tf.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    model.config.quantization_config = {"quant_method": "compressed-tensors",
                                        "kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "tensor"}}
    kvt.enable(model, kvfuse.KVCacheConfig())  # "auto": the checkpoint's fp8 applies
    layers = kvt.kvfuse_layers(model)
    assert all(layer.spec.kv_quant_mode is KVQuantMode.FP8_E4M3 and "checkpoint" in layer.spec.reason
               for layer in layers)
    assert [(float(layer.k_scale), float(layer.v_scale)) for layer in layers] == [(0.5, 0.25), (2.0, 4.0)]
    # The user's explicit dtype wins over the checkpoint's scheme; scales are not applied to bf16.
    kvt.enable(model, kvfuse.KVCacheConfig(kv_cache_dtype="bfloat16"))
    assert all(layer.spec.kv_quant_mode is KVQuantMode.NONE for layer in kvt.kvfuse_layers(model))
    # Legacy single kv_scale, passed explicitly; per-head scales are refused by name.
    kvt.enable(model, kvfuse.KVCacheConfig(kv_cache_dtype="fp8"),
               kv_scales={"model.layers.0.self_attn.kv_scale": 3.0})
    assert float(kvt.kvfuse_layers(model)[0].k_scale) == 3.0 == float(kvt.kvfuse_layers(model)[0].v_scale)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_scale' has shape \(2,\).*per-head"):
        kvt.enable(model, kvfuse.KVCacheConfig(kv_cache_dtype="fp8"),
                   kv_scales={"model.layers.0.self_attn.k_scale": torch.ones(2),
                              "model.layers.0.self_attn.v_scale": torch.ones(2)})
    assert kvt.checkpoint_kv_cache_dtype(type("C", (), {"quantization_config": {
        "quant_method": "modelopt", "kv_cache_quant_algo": "NVFP4"}})()) == "nvfp4"
    with pytest.raises(ValueError, match="kv_cache_scheme=.*'num_bits': 16"):
        kvt.checkpoint_kv_cache_dtype(type("C", (), {"quantization_config": {
            "kv_cache_scheme": {"type": "int", "num_bits": 16}}})())


def test_the_cache_under_either_keyword():
    """transformers 5.24 renamed the forward keyword ``past_key_values`` to ``cache`` (the old name
    still maps onto it): the hook takes the caller's KVFuseCache under either name and hands it
    to the model under the model's own, and refuses two different caches at once."""
    import inspect

    model = kvt.enable(build("llama"), kvfuse.KVCacheConfig())
    ids, mask = left_padded_batch()
    own = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    for keyword in {own, "past_key_values"}:
        cache = kvt.KVFuseCache(model)
        out = model(input_ids=ids, attention_mask=mask, **{keyword: cache})
        assert out.past_key_values is cache and cache.get_seq_length() == 9
        nxt = out.logits[:, -1:].argmax(-1)
        step = model(input_ids=nxt, attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1),
                     position_ids=mask.sum(1, keepdim=True), **{keyword: cache})
        assert step.past_key_values is cache and cache.get_seq_length() == 10
    if own == "cache":
        with pytest.raises(ValueError, match="both cache=KVFuseCache and past_key_values=KVFuseCache"):
            model(input_ids=ids, attention_mask=mask, cache=kvt.KVFuseCache(model),
                  past_key_values=kvt.KVFuseCache(model))


def test_clear_errors():
    ref = build("llama")
    model = kvt.enable(copy.deepcopy(ref), kvfuse.KVCacheConfig())
    ids, mask = left_padded_batch()
    from transformers import DynamicCache

    full = DynamicCache(config=ref.config)
    ref(input_ids=ids, attention_mask=mask, past_key_values=full)
    with pytest.raises(ValueError, match="past_key_values is a DynamicCache holding 9 positions"):
        model(input_ids=ids, attention_mask=mask, past_key_values=full)
    with pytest.raises(NotImplementedError, match="beam search"):
        model.generate(input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=2, pad_token_id=0)
    with pytest.raises(ValueError, match="2-D"):
        model(input_ids=ids, attention_mask=torch.ones(3, 1, 9, 9))
    model.model.layers[1].self_attn.scaling = 0.3
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.attn.*scaling=0.3.*planned 0.25"):
        model(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="block_size=0"):
        kvt.enable(model, kvfuse.KVCacheConfig(), block_size=0)
    with pytest.raises(ValueError, match="KVCacheConfig"):
        kvt.enable(model, {"kv_cache_dtype": "fp8"})


def test_enable_reports_skip_rules_that_match_no_layer(caplog):
    """Issue 19, item 3: the integration knows every layer, so an unmatched rule is reported (or refused)."""
    import logging

    model = build("llama")
    with caplog.at_level(logging.WARNING):
        kvt.enable(model, kvfuse.KVCacheConfig(kv_cache_dtype="fp8", skip_layers=("7", "sliding_window")))
    assert "'7'" in caplog.text and "'sliding_window'" in caplog.text
    with pytest.raises(ValueError, match="'7'"):
        kvt.enable(build("llama"),
               kvfuse.KVCacheConfig(kv_cache_dtype="fp8", skip_layers=("7",), strict_skip_layers=True))


def test_per_head_checkpoint_scales_load_into_per_head_layers():
    """vLLM's kv_scale_type="attn_head": one scale per KV head, loaded as is by per-head layers."""
    model = build("llama")
    heads = model.config.num_key_value_heads
    k = torch.tensor([0.5, 2.0][:heads])
    scales = {"model.layers.0.self_attn.k_scale": k, "model.layers.0.self_attn.v_scale": torch.tensor(0.25),
              "model.layers.1.self_attn.k_proj.k_scale": k * 3, "model.layers.1.self_attn.v_proj.v_scale": k * 5}
    kvt.enable(model, kvfuse.KVCacheConfig(kv_cache_dtype="fp8", kv_scale_granularity="attn_head"), kv_scales=scales)
    layers = kvt.kvfuse_layers(model)
    assert [(layer.k_scale.tolist(), layer.v_scale.tolist()) for layer in layers] == [
        (k.tolist(), [0.25] * heads), ((k * 3).tolist(), (k * 5).tolist())]
    ids, mask = left_padded_batch()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()
    with pytest.raises(ValueError, match=r"checkpoint scales \['model.layers.0.self_attn.k_scale', .*k_scale has 3 "
                                         r"values.*one per KV head \(2"):
        kvt.enable(model, kvfuse.KVCacheConfig(kv_cache_dtype="fp8", kv_scale_granularity="head"),
                   kv_scales={"model.layers.0.self_attn.k_scale": torch.ones(3),
                              "model.layers.0.self_attn.v_scale": torch.ones(3)})
