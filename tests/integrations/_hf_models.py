"""Tiny random-weight transformers models (built from configs, nothing downloaded) for kvfuse tests."""

from __future__ import annotations

from typing import Optional

import torch

VOCAB = 96


def _common(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                eos_token_id=2, initializer_range=0.08)
    base.update(kw)
    return base


def build(name: str, dtype=torch.float32, seed: int = 0, head_dim: Optional[int] = None):
    """A tiny eval-mode ``*ForCausalLM`` with transformers' eager attention, in ``dtype``;
    ``head_dim`` replaces the model's own (16, gemma2 256, gemma3 32)."""
    import transformers as tf

    def common(**kw):
        return _common(**kw, **({} if head_dim is None else {"head_dim": head_dim}))

    torch.manual_seed(seed)
    if name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common()))
    elif name == "qwen3":  # QK-norm
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common(num_key_value_heads=1)))
    elif name == "mistral":  # one sliding window on every layer, shorter than the test sequences
        model = tf.MistralForCausalLM(tf.MistralConfig(**common(sliding_window=5)))
    elif name == "gemma2":  # soft-capping, alternating windows, head_dim 256, query_pre_attn_scalar
        cfg = tf.Gemma2Config(**{**common(sliding_window=6, attn_logit_softcapping=1.5, final_logit_softcapping=30.0,
                                          query_pre_attn_scalar=64), "head_dim": head_dim or 256})
        model = tf.Gemma2ForCausalLM(cfg)
    elif name == "gemma3":  # 5 local : 1 global over 6 layers, query_pre_attn_scalar
        cfg = tf.Gemma3TextConfig(**{**common(num_hidden_layers=6, sliding_window=4, query_pre_attn_scalar=24),
                                     "head_dim": head_dim or 32})
        model = tf.Gemma3ForCausalLM(cfg)
    elif name == "gpt_oss":  # attention sinks, alternating windows, a tiny MoE
        cfg = tf.GptOssConfig(**common(num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                                       intermediate_size=32, max_position_embeddings=131072))
        model = tf.GptOssForCausalLM(cfg)
        with torch.no_grad():  # sinks around the scores' range, so they take a visible share
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.5)
    else:
        raise ValueError(f"unknown test model {name!r}")
    model.set_attn_implementation("eager")
    return model.to(dtype).eval()


def left_padded_batch(lengths=(9, 4, 6), seed: int = 1):
    """Three prompts of different lengths, left-padded with token 0, and their attention mask
    (the accuracy benchmark's prompt builder, on these models' vocabulary)."""
    from benchmarks.kv_accuracy import prompts

    return prompts(lengths, seed, vocab=VOCAB)


def teacher_forced_logits(model, ids, mask, tokens):
    """Prefill, then one decode step per column of ``tokens`` ([B, n]): logits of every step."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        logits, cache, pos = [out.logits[:, -1]], out.past_key_values, mask.sum(1, keepdim=True)
        for i in range(tokens.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            out = model(input_ids=tokens[:, i:i + 1], attention_mask=mask, past_key_values=cache, position_ids=pos)
            logits.append(out.logits[:, -1])
            cache, pos = out.past_key_values, pos + 1
    return torch.stack(logits, 1).float()


def greedy_tokens(ref, ids, mask, steps: int = 6):
    """transformers' own greedy continuation ([B, steps]): both sides of a comparison are then fed
    the same tokens, so a near-tie argmax flipped by rounding cannot hide (or fake) a difference."""
    return ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                        pad_token_id=0)[:, ids.shape[1]:]


def compile_forward(model, backend):
    """``model.forward`` compiled with ``backend``, after a Dynamo reset: every compile of a model
    class's forward counts against Dynamo's recompile limit; past it, Dynamo runs the forward
    uncompiled and the report stays empty."""
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=backend)
    return model


def rotary_fusion_reasons(ref, ids, mask, kv_config, max_new_tokens: int = 3) -> list:
    """``generate`` of ``ref`` on kvfuse caches (``kv_config``) compiled by kvfuse's backend with
    and without its rewrite. Asserts the same tokens, scores and cache bytes (every layer written);
    returns the rewritten run's record reasons, in layer order."""
    import copy

    import kvfuse
    from kvfuse.integrations import transformers as kvt

    runs = []
    for fuse in (True, False):
        model = kvt.enable(copy.deepcopy(ref), kv_config)
        be = kvfuse.make_backend(fuse=fuse, force_disable_caches=True)
        compile_forward(model, be)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
        runs.append((out, [c.clone() for c in cache.kv_caches], [r.reason for r in be.report]))
    torch._dynamo.reset()
    (fused, fused_caches, reasons), (unfused, unfused_caches, _) = runs
    assert torch.equal(fused.sequences, unfused.sequences)
    for a, b in zip(fused.scores, unfused.scores):
        assert torch.equal(a, b)
    assert len(fused_caches) == len(unfused_caches) == len(reasons) > 0
    for i, (a, b) in enumerate(zip(fused_caches, unfused_caches)):
        assert (a.view(torch.uint8) != 0).any(), f"layer {i}: nothing written"
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"layer {i}: cache bytes differ"
    return reasons
