"""kvfuse.calibrate_scales: static K/V scales from forward passes, on the demo model and on transformers."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

import kvfuse
from kvfuse import KVCacheConfig, KVQuantMode, KVScaleGranularity, PagedAttention
from kvfuse.calibration import ScaleCalibration, format_max
from kvfuse.models.demo import make_batch, run_steps
from kvfuse.models.llama import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).parent / "integrations"))  # _hf_models: the tiny transformers models


@pytest.fixture(autouse=True)
def _reference_ops(reference_backend):
    """The ops on the reference: calibration is about what the layers see, not which kernel runs."""


class AmaxRecorder:
    """An independent observer: its own pre-hooks keep every written K/V row per layer."""

    def __init__(self, model):
        self.rows = {}
        self.handles = [m.register_forward_pre_hook(self._hook(m.layer_name)) for m in model.modules()
                        if isinstance(m, PagedAttention)]

    def _hook(self, name):
        def hook(module, args):
            key, value, metadata = args[1], args[2], args[4]
            written = metadata.slot_mapping >= 0
            self.rows.setdefault(name, []).append((key[written].float(), value[written].float()))
        return hook

    def amax(self, name, per_head):
        k = torch.cat([k for k, _ in self.rows[name]]).abs()
        v = torch.cat([v for _, v in self.rows[name]]).abs()
        if per_head:
            return k.amax(dim=(0, 2)), v.amax(dim=(0, 2))
        return k.max(), v.max()

    def remove(self):
        for h in self.handles:
            h.remove()


def _demo(kv_config, num_layers=3):
    cfg = LlamaConfig(num_layers=num_layers, hidden_size=64, num_heads=4, num_kv_heads=2, head_size=16,
                      intermediate_size=96, vocab_size=128)
    return LlamaForCausalLM(cfg, kv_config)


@pytest.mark.parametrize("dtype_name,granularity", [("fp8", "head"), ("fp8_e5m2", "tensor"), ("nvfp4", "head"),
                                                    ("nvfp4", "tensor")])
def test_demo_model_scales_equal_independent_amax(dtype_name, granularity):
    model = _demo(KVCacheConfig(dtype_name, skip_layers=("0",), kv_scale_granularity=granularity))
    batches = [make_batch(128, [9, 4], decode_steps=2, seed=s) for s in (0, 1)]
    recorder = AmaxRecorder(model)
    result = kvfuse.calibrate_scales(model, batches, forward=lambda b: run_steps(model, b, pad_to=16))
    recorder.remove()

    layers = model.attention_layers
    assert list(result) == [a.layer_name for a in layers[1:]], "the skip layer is not calibrated"
    assert layers[0].spec.kv_quant_mode is KVQuantMode.NONE
    assert float(layers[0].k_scale) == 1.0 == float(layers[0].v_scale)
    per_head = granularity == "head"
    fmax = {"fp8": 448.0, "fp8_e5m2": 57344.0, "nvfp4": 448.0 * 6}[dtype_name]
    for layer in layers[1:]:
        r = result[layer.layer_name]
        assert isinstance(r, ScaleCalibration) and r.kv_quant_mode is layer.spec.kv_quant_mode
        assert r.granularity is KVScaleGranularity(granularity)
        assert r.tokens == 2 * (13 + 2 * 2)  # real tokens only: the padding rows (slot -1) do not count
        k_amax, v_amax = recorder.amax(layer.layer_name, per_head)
        assert layer.k_scale.shape == ((2,) if per_head else ())
        torch.testing.assert_close(layer.k_scale, k_amax / fmax, atol=0, rtol=0)
        torch.testing.assert_close(layer.v_scale, v_amax / fmax, atol=0, rtol=0)
        assert r.k_scale == layer.k_scale.tolist() and r.v_amax == v_amax.tolist()
        if per_head:
            assert r.k_amax[0] != r.k_amax[1]


def test_tensor_calibration_of_a_per_head_layer_and_refusals():
    model = _demo(KVCacheConfig("fp8", kv_scale_granularity="head"), num_layers=2)
    batch = make_batch(128, [6], decode_steps=0)
    result = kvfuse.calibrate_scales(model, [batch], "tensor", forward=lambda b: run_steps(model, b))
    for layer in model.attention_layers:
        assert result[layer.layer_name].granularity is KVScaleGranularity.TENSOR
        assert layer.k_scale.shape == (2,) and layer.k_scale[0] == layer.k_scale[1]
    flat = _demo(KVCacheConfig("fp8"), num_layers=2)
    with pytest.raises(ValueError, match=r"granularity='head': layer 'model.layers.0.self_attn.attn' holds one "
                                         r"scale per tensor.*kv_scale_granularity='head'"):
        kvfuse.calibrate_scales(flat, [batch], "attn_head", forward=lambda b: run_steps(flat, b))
    with pytest.raises(ValueError, match=r"granularity='row' is not a scale granularity"):
        kvfuse.calibrate_scales(flat, [batch], "row")
    with pytest.raises(ValueError, match="batches is empty"):
        kvfuse.calibrate_scales(flat, [], forward=lambda b: run_steps(flat, b))
    with pytest.raises(ValueError, match=r"Linear has no kvfuse.PagedAttention layer"):
        kvfuse.calibrate_scales(torch.nn.Linear(2, 2), [torch.ones(2)])
    # A refused call installs nothing: the layers run without hooks afterwards.
    assert all(not layer._forward_pre_hooks for layer in flat.attention_layers)


def test_demo_model_loads_per_head_checkpoint_scales():
    model = _demo(KVCacheConfig("fp8", kv_scale_granularity="head"), num_layers=2)
    state = model.state_dict()
    state["model.layers.1.self_attn.attn.k_scale"] = torch.tensor([0.5, 2.0])  # one per KV head
    state["model.layers.1.self_attn.attn.v_scale"] = torch.tensor(0.25)  # per tensor: every head
    model.load_state_dict(state)
    attn = model.attention_layers[1]
    assert attn.k_scale.tolist() == [0.5, 2.0] and attn.v_scale.tolist() == [0.25, 0.25]


def test_format_max():
    assert format_max(KVQuantMode.FP8_E4M3) == 448.0 and format_max(KVQuantMode.FP8_E5M2) == 57344.0
    assert format_max(KVQuantMode.NVFP4) == 448.0 * 6
    with pytest.raises(ValueError, match="NONE has no scales"):
        format_max(KVQuantMode.NONE)


# ----------------------------------------------------------------------------- transformers


def _outlier_llama(gain):
    """A tiny random Llama whose K/V have outliers: every k_proj/v_proj weight times ``gain`` (typical
    |K| in the tens, as in trained checkpoints) and two output channels times 50 more."""
    pytest.importorskip("transformers")
    from _hf_models import build

    model = build("llama", torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight *= gain
                proj.weight[[3, 21]] *= 50
    return model


@pytest.mark.parametrize("dtype_name,gain,ratio", [("fp8", 30.0, 0.5), ("nvfp4", 100.0, 0.9)])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_transformers_calibration_brings_logits_closer_to_bf16_cache(dtype_name, gain, ratio, granularity):
    """With outliers beyond the format's range at scale 1.0 (e4m3: 448; NVFP4: 448 * 6), calibrated
    scales give logits much closer to those of an unquantized cache."""
    ref = _outlier_llama(gain)
    from _hf_models import left_padded_batch
    from kvfuse.integrations import transformers as kvt

    ids, mask = left_padded_batch((9, 4, 6))
    real = mask.bool()
    with torch.no_grad():
        want = kvt.enable(copy.deepcopy(ref), KVCacheConfig())(input_ids=ids, attention_mask=mask).logits[real]
    model = kvt.enable(copy.deepcopy(ref), KVCacheConfig(dtype_name, kv_scale_granularity=granularity))

    @torch.no_grad()
    def error():
        got = model(input_ids=ids, attention_mask=mask).logits[real]
        return float((got - want).norm() / want.norm())

    before = error()
    cal_ids, cal_mask = left_padded_batch((12, 7, 10), seed=5)
    recorder = AmaxRecorder(model)
    result = kvfuse.calibrate_scales(model, [dict(input_ids=cal_ids, attention_mask=cal_mask)])
    recorder.remove()
    after = error()
    assert after < ratio * before, (before, after)
    layers = kvt.kvfuse_layers(model)
    assert list(result) == [layer.layer_name for layer in layers]
    for layer in layers:
        k_amax, v_amax = recorder.amax(layer.layer_name, granularity == "head")
        assert float(k_amax.max()) > format_max(layer.spec.kv_quant_mode), "the outliers exceed the range at 1.0"
        torch.testing.assert_close(layer.k_scale, k_amax / format_max(layer.spec.kv_quant_mode), atol=0, rtol=0)
        torch.testing.assert_close(layer.v_scale, v_amax / format_max(layer.spec.kv_quant_mode), atol=0, rtol=0)
        assert result[layer.layer_name].tokens == int(cal_mask.sum())
