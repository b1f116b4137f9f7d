"""A transformers model on fp8_per_token_head caches vs the same model on a bf16 cache (tiny, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import kvfuse  # noqa: E402
from kvfuse.integrations import transformers as kvt  # noqa: E402
from kvfuse.kv_cache import KVQuantMode, KVScaleGranularity  # noqa: E402

from _hf_models import build, greedy_tokens, left_padded_batch, teacher_forced_logits  # noqa: E402




def test_llama_generates_on_per_token_head_cache_within_bound():
    ref = build("llama")  # head_dim 16: rows of 16 e4m3 bytes + a float32 scale
    pth = kvt.enable(copy.deepcopy(ref), kvfuse.KVCacheConfig(kv_cache_dtype="fp8_per_token_head"))
    bf16 = kvt.enable(copy.deepcopy(ref), kvfuse.KVCacheConfig(kv_cache_dtype="bfloat16"))
    for layer in kvt.kvfuse_layers(pth):
        spec = layer.spec
        assert spec.kv_quant_mode is KVQuantMode.FP8_PER_TOKEN_HEAD and spec.kv_cache_torch_dtype == torch.uint8
        assert spec.row_dim == 16 + 4 and spec.scale_granularity is KVScaleGranularity.TOKEN_HEAD
    ids, mask = left_padded_batch()
    # Both runs are fed the bf16-cache run's greedy tokens, so a flipped near-tie cannot hide a difference.
    tokens = greedy_tokens(bf16, ids, mask)
    want = teacher_forced_logits(bf16, ids, mask, tokens)
    got = teacher_forced_logits(pth, ids, mask, tokens)
    # Stated bound: every logit of every step within 5% of the logits' range of the bf16-cache run
    # (e4m3 keeps 4 significant bits per cached element, each row scaled to its own amax; measured 2.8%,
    # per-tensor FP8 with scale 1.0 3.0% on these random weights).
    err = (got - want).abs().max().item()
    assert 0 < err < 0.05 * want.abs().max().item(), err
    out = pth.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (3, ids.shape[1] + 6)
    assert isinstance(pth.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                                   pad_token_id=0, return_dict_in_generate=True).past_key_values, kvt.KVFuseCache)


def test_checkpoint_scales_are_ignored_by_per_token_head_layers():
    # vLLM ignores a checkpoint's k_scale / v_scale for per-token-head caches; so does kvfuse.
    model = kvt.enable(build("llama"), kvfuse.KVCacheConfig(kv_cache_dtype="fp8_per_token_head"))
    names = [n for n, _ in kvt._attention_modules(model)]
    scales = {f"{n}.{which}_proj.{which}_scale": torch.tensor(0.5) for n in names for which in "kv"}
    assert kvt.load_kv_scales(model, scales=scales) == {}
    assert all(float(layer.k_scale) == 1.0 for layer in kvt.kvfuse_layers(model))
