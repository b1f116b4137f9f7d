"""The KV-cache dtype model: parsing, per-layer precedence, specs, allocation, NVFP4/FP8 numerics."""

import itertools
import math

import pytest
import torch

import kvfuse
from kvfuse import KVCacheConfig, KVQuantMode, allocate_kv_cache, parse_kv_cache_dtype
from kvfuse.kv_cache import (
    E2M1_VALUES,
    fp8_max,
    layer_index_from_name,
    nvfp4_dequantize_reference,
    nvfp4_quantize_reference,
    nvfp4_row_dim,
    nvfp4_split,
)
from kvfuse.ops import reference

ALIASES = {
    "auto": KVQuantMode.NONE,
    "float16": KVQuantMode.NONE,
    "half": KVQuantMode.NONE,
    "bfloat16": KVQuantMode.NONE,
    "float32": KVQuantMode.NONE,
    "float": KVQuantMode.NONE,
    "fp8": KVQuantMode.FP8_E4M3,
    "fp8_e4m3": KVQuantMode.FP8_E4M3,
    "fp8_inc": KVQuantMode.FP8_E4M3,  # vLLM's name, same float8_e4m3fn storage
    "fp8_e5m2": KVQuantMode.FP8_E5M2,
    "nvfp4": KVQuantMode.NVFP4,
    "fp8_per_token_head": KVQuantMode.FP8_PER_TOKEN_HEAD,  # vLLM's name and layout
}
# Storage dtype of each explicit name when the model runs in bf16.
EXPLICIT_STORAGE = {
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_inc": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "nvfp4": torch.uint8,
    "fp8_per_token_head": torch.uint8,
}

# ----------------------------------------------------------------------------- parsing


def test_enum_values_are_the_abi():
    assert [(m.name, int(m)) for m in KVQuantMode] == [("NONE", 0), ("FP8_E4M3", 1), ("FP8_E5M2", 2), ("NVFP4", 3),
                                                     ("FP8_PER_TOKEN_HEAD", 4)]
    assert kvfuse.KVQuantMode is KVQuantMode


@pytest.mark.parametrize("name,mode", sorted(ALIASES.items()))
def test_every_alias(name, mode):
    assert parse_kv_cache_dtype(name) is mode
    assert parse_kv_cache_dtype(name.upper()) is mode
    assert parse_kv_cache_dtype(f"  {name} ") is mode


@pytest.mark.parametrize("bad", ["fp9", "bf16", "fp8_e4m3fn", "nvfp8", "", "fp4", "int8", None, 8, torch.bfloat16])
def test_bad_name_error_names_value_and_every_valid_name(bad):
    with pytest.raises(ValueError) as info:
        parse_kv_cache_dtype(bad)
    message = str(info.value)
    assert repr(bad) in message
    for name in ALIASES:
        assert repr(name) in message


def test_fp8_inc_is_fp8_e4m3_storage():
    a = KVCacheConfig("fp8_inc").layer_spec("model.layers.0.attn", 2, 64)
    b = KVCacheConfig("fp8_e4m3").layer_spec("model.layers.0.attn", 2, 64)
    assert (a.kv_quant_mode, a.kv_cache_torch_dtype, a.bytes_per_token) == (
        b.kv_quant_mode, b.kv_cache_torch_dtype, b.bytes_per_token)


@pytest.mark.parametrize("field", ["kv_cache_dtype", "checkpoint_kv_cache_dtype"])
def test_config_rejects_bad_dtype_naming_the_field(field):
    with pytest.raises(ValueError, match=f"{field}='fp9'.*'nvfp4'"):
        KVCacheConfig(**{field: "fp9"})


# ----------------------------------------------------------------------------- skip rules


@pytest.mark.parametrize("rule,hint", [("sliding-window", True), ("Sliding Window", True), ("abc", False),
                                       ("layers", False), ("-1", False), ("1.5", False)])
def test_bad_skip_rules_are_rejected_with_a_message(rule, hint):
    with pytest.raises(ValueError) as info:
        KVCacheConfig(kv_cache_dtype="fp8", skip_layers=(rule,))
    message = str(info.value)
    assert repr(rule) in message
    assert "'sliding_window'" in message and "layer index" in message
    assert ("did you mean 'sliding_window'" in message) == hint


@pytest.mark.parametrize("rule", [True, -2, 1.0, None])
def test_bad_skip_rule_types(rule):
    with pytest.raises(ValueError, match=repr(rule).replace(".", r"\.")):
        KVCacheConfig(skip_layers=(rule,))


def test_skip_rules_are_normalised():
    cfg = KVCacheConfig(skip_layers=[0, " 3 ", "sliding_window", "model.layers.5.attn"])
    assert cfg.skip_layers == ("0", "3", "sliding_window", "model.layers.5.attn")
    assert KVCacheConfig(skip_layers=2).skip_layers == ("2",)
    assert KVCacheConfig(skip_layers="sliding_window").skip_layers == ("sliding_window",)
    with pytest.raises(ValueError, match="skip_layers=.*sequence"):
        KVCacheConfig(skip_layers=object())


def test_config_is_frozen():
    cfg = KVCacheConfig("fp8")
    with pytest.raises(Exception):
        cfg.kv_cache_dtype = "nvfp4"


# ----------------------------------------------------------------------------- layer index


@pytest.mark.parametrize("name,index", [
    ("model.layers.3.attn", 3),
    ("model.layers.17.self_attn.attn", 17),
    ("layers.0", 0),
    ("attn", None),
    ("model.layers.3.experts.7.attn", None),  # two all-digit components: ambiguous
    ("h2o.layers.3.attn", 3),  # digits inside a component do not count (as in vLLM)
    ("model.layers.3.fp8_attn", 3),
    ("model.layers.12.mlp.fc2", 12),
    ("layer3.attn", None),
])
def test_layer_index_from_name(name, index):
    assert layer_index_from_name(name) == index


def test_unknown_index_with_index_rule_raises_and_keyword_fixes_it():
    cfg = KVCacheConfig("fp8", skip_layers=("3",))
    with pytest.raises(ValueError) as info:
        cfg.layer_spec("model.blocks.3.experts.1.attn", 8, 128)
    assert "'model.blocks.3.experts.1.attn'" in str(info.value) and "layer_index=" in str(info.value)
    with pytest.raises(ValueError, match="layer_index="):
        cfg.layer_spec("decoder_attention", 8, 128)
    assert cfg.layer_spec("model.blocks.3.experts.1.attn", 8, 128, layer_index=3).kv_quant_mode is KVQuantMode.NONE
    assert cfg.layer_spec("model.blocks.3.experts.1.attn", 8, 128, layer_index=1).kv_quant_mode is KVQuantMode.FP8_E4M3
    # Without index rules an index is never needed.
    assert KVCacheConfig("fp8").layer_spec("decoder_attention", 8, 128).kv_quant_mode is KVQuantMode.FP8_E4M3


def test_index_rule_with_digits_inside_components():
    cfg = KVCacheConfig("fp8", skip_layers=("3",))
    assert cfg.layer_spec("model.layers.3.fp8_attn", 8, 128).kv_quant_mode is KVQuantMode.NONE
    assert cfg.layer_spec("model.layers.8.fp8_attn", 8, 128).kv_quant_mode is KVQuantMode.FP8_E4M3
    with pytest.raises(ValueError, match="exactly one all-digit dotted component"):
        cfg.layer_spec("model.layers.3.experts.3.attn", 8, 128)


def _four_layer_specs(cfg, windowed=()):
    return [cfg.layer_spec(f"model.layers.{i}.attn", 2, 64, sliding_window=64 if i in windowed else None)
            for i in range(4)]


@pytest.mark.parametrize("rule", ["7", "layers.0", "model.layers.0.attention", "sliding_window"])
def test_skip_rule_matching_no_layer_warns_and_strict_raises(rule, caplog):
    cfg = KVCacheConfig("fp8", skip_layers=("1", rule))
    specs = _four_layer_specs(cfg)
    assert cfg.unmatched_skip_rules(specs) == (rule,)
    with caplog.at_level("WARNING", logger="kvfuse.kv_cache"):
        assert cfg.check_skip_rules(specs) == (rule,)
    (record,) = [r for r in caplog.records if r.name == "kvfuse.kv_cache"]
    assert f"{rule!r} matches no layer" in record.getMessage() and "'model.layers.0.attn'" in record.getMessage()
    assert "indices 0..3" in record.getMessage()
    with pytest.raises(ValueError, match=f"{rule!r} matches no layer"):
        cfg.check_skip_rules(specs, strict=True)
    strict = KVCacheConfig("fp8", skip_layers=("1", rule), strict_skip_layers=True)
    with pytest.raises(ValueError, match="matches no layer"):
        strict.check_skip_rules(_four_layer_specs(strict))


def test_skip_rules_that_match_are_silent(caplog):
    cfg = KVCacheConfig("fp8", skip_layers=("3", "sliding_window", "model.layers.0.attn"), strict_skip_layers=True)
    specs = _four_layer_specs(cfg, windowed=(2,))
    with caplog.at_level("WARNING"):
        assert cfg.check_skip_rules(specs) == ()
    assert not caplog.records
    assert [s.kv_quant_mode for s in specs] == [KVQuantMode.NONE, KVQuantMode.FP8_E4M3, KVQuantMode.NONE,
                                                 KVQuantMode.NONE]
    with pytest.raises(ValueError, match="strict_skip_layers='yes' must be a bool"):
        KVCacheConfig(strict_skip_layers="yes")


@pytest.mark.parametrize("name,dtype", [("bfloat16", torch.bfloat16), ("half", torch.float16),
                                        ("Float32", torch.float32), (torch.float16, torch.float16)])
def test_model_dtype_by_name(name, dtype):
    spec = KVCacheConfig("auto").layer_spec("model.layers.0.attn", 2, 64, model_dtype=name)
    assert spec.model_dtype == dtype and spec.kv_cache_torch_dtype == dtype


@pytest.mark.parametrize("bad", ["float64", "fp8", "auto", "nvfp4", torch.float64, torch.float8_e4m3fn, 16])
def test_model_dtype_errors_list_only_native_names(bad):
    with pytest.raises(ValueError) as info:
        KVCacheConfig().layer_spec("model.layers.0.attn", 2, 64, model_dtype=bad)
    message = str(info.value)
    assert f"model_dtype={bad!r}" in message and "'bfloat16'" in message and "'half'" in message
    for quantized in ("fp8", "nvfp4", "'auto'", "e5m2"):
        assert quantized not in message.split("must name")[1], message


def test_layer_index_keyword_overrides_the_name():
    cfg = KVCacheConfig("fp8", skip_layers=("2",))
    spec = cfg.layer_spec("model.layers.5.attn", 8, 128, layer_index=2)
    assert spec.layer_index == 2 and spec.kv_quant_mode is KVQuantMode.NONE
    with pytest.raises(ValueError, match="layer_index=-1"):
        cfg.layer_spec("model.layers.5.attn", 8, 128, layer_index=-1)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_kv_heads=0), "num_kv_heads=0"),
    (dict(head_size=-128), "head_size=-128"),
    (dict(model_dtype=torch.float8_e4m3fn), "model_dtype=torch.float8_e4m3fn"),
    (dict(sliding_window=0), "sliding_window=0"),
    (dict(layer_name=""), "layer_name=''"),
])
def test_layer_spec_argument_errors(kwargs, match):
    args = dict(layer_name="model.layers.0.attn", num_kv_heads=8, head_size=128)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        KVCacheConfig().layer_spec(**args)


# ----------------------------------------------------------------------------- precedence matrix


def _expected(explicit, checkpoint, skipped, model_dtype):
    """The DESIGN.md precedence rule, restated independently of kv_cache.py."""
    if skipped:
        return KVQuantMode.NONE, model_dtype, "skip rule"
    if explicit != "auto":
        storage = EXPLICIT_STORAGE[explicit]
        return ALIASES[explicit], storage, "explicit"
    if checkpoint is not None:
        if checkpoint == "auto":
            return KVQuantMode.NONE, model_dtype, "checkpoint"
        return ALIASES[checkpoint], EXPLICIT_STORAGE[checkpoint], "checkpoint"
    return KVQuantMode.NONE, model_dtype, "auto"


SKIP_CASES = {
    # name: (skip_layers, layer_name, sliding_window, layer is skipped)
    "none": ((), "model.layers.3.attn", None, False),
    "index-hit": (("3",), "model.layers.3.attn", None, True),
    "index-int-hit": ((3,), "model.layers.3.attn", None, True),
    "index-miss": (("2",), "model.layers.3.attn", None, False),
    "window-hit": (("sliding_window",), "model.layers.3.attn", 1024, True),
    "window-miss": (("sliding_window",), "model.layers.3.attn", None, False),
    "name-hit": (("model.layers.3.attn",), "model.layers.3.attn", None, True),
    "name-miss": (("model.layers.30.attn",), "model.layers.3.attn", None, False),
    "many": (("0", "sliding_window", "model.layers.9.attn"), "model.layers.3.attn", 64, True),
}


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("skip_case", sorted(SKIP_CASES))
@pytest.mark.parametrize("checkpoint", [None, "auto", "fp8", "fp8_e5m2", "nvfp4", "bfloat16", "float32"])
@pytest.mark.parametrize("explicit", ["auto", "bfloat16", "float16", "half", "float32", "float", "fp8",
                                      "fp8_e4m3", "fp8_e5m2", "nvfp4"])
def test_precedence_matrix(explicit, checkpoint, skip_case, model_dtype):
    skip_layers, layer_name, window, skipped = SKIP_CASES[skip_case]
    cfg = KVCacheConfig(kv_cache_dtype=explicit, skip_layers=skip_layers, checkpoint_kv_cache_dtype=checkpoint)
    spec = cfg.layer_spec(layer_name, num_kv_heads=4, head_size=64, model_dtype=model_dtype, sliding_window=window)
    mode, storage, why = _expected(explicit, checkpoint, skipped, model_dtype)
    assert (spec.kv_quant_mode, spec.kv_cache_torch_dtype) == (mode, storage)
    assert spec.model_dtype == model_dtype and spec.sliding_window == window and spec.layer_index == 3
    assert why in spec.reason
    if why == "explicit":
        assert repr(explicit) in spec.reason
    if why == "checkpoint":
        assert repr(checkpoint) in spec.reason


def test_explicit_native_dtype_beats_quantized_checkpoint():
    # vLLM PR 42782: --kv-cache-dtype bfloat16 was silently replaced by the checkpoint's fp8.
    spec = KVCacheConfig("bfloat16", checkpoint_kv_cache_dtype="fp8").layer_spec(
        "model.layers.0.attn", 8, 128, model_dtype=torch.float16)
    assert spec.kv_quant_mode is KVQuantMode.NONE
    assert spec.kv_cache_torch_dtype == torch.bfloat16


def test_reason_names_the_matching_rule():
    cfg = KVCacheConfig("fp8", skip_layers=("model.layers.1.attn", "sliding_window", "0"))
    assert "'0'" in cfg.layer_spec("model.layers.0.attn", 8, 128).reason
    assert "'model.layers.1.attn'" in cfg.layer_spec("model.layers.1.attn", 8, 128).reason
    assert "sliding window 512" in cfg.layer_spec("model.layers.2.attn", 8, 128, sliding_window=512).reason


def test_nvfp4_head_size_checked_per_layer():
    cfg = KVCacheConfig("nvfp4", skip_layers=("1",))
    with pytest.raises(ValueError, match=r"model.layers.0.attn.*head_size=72.*multiple of 16"):
        cfg.layer_spec("model.layers.0.attn", 8, 72)
    # A skipped layer keeps the model dtype, so its head size is irrelevant to NVFP4.
    assert cfg.layer_spec("model.layers.1.attn", 8, 72).kv_quant_mode is KVQuantMode.NONE


# ----------------------------------------------------------------------------- spec and allocation


@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32", "fp8", "fp8_e5m2", "nvfp4"])
def test_spec_geometry(name, head_size):
    if name == "nvfp4" and head_size % 16:
        pytest.skip("NVFP4 needs head_size % 16 == 0")
    spec = KVCacheConfig(name).layer_spec("model.layers.0.attn", num_kv_heads=3, head_size=head_size)
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "fp8_e5m2": 1, "nvfp4": 1}[name]
    row_dim = head_size // 2 + head_size // 16 if name == "nvfp4" else head_size
    assert spec.row_dim == row_dim
    assert spec.cache_shape(5, 16) == (5, 2, 16, 3, row_dim)
    assert spec.bytes_per_token == 2 * 3 * row_dim * itemsize
    bf16 = KVCacheConfig("bfloat16").layer_spec("model.layers.0.attn", num_kv_heads=3, head_size=head_size)
    ratio = {"bfloat16": 1, "float16": 1, "float32": 2, "fp8": 0.5, "fp8_e5m2": 0.5, "nvfp4": 0.28125}[name]
    assert spec.bytes_per_token == bf16.bytes_per_token * ratio


def test_nvfp4_row_dim_values():
    assert [nvfp4_row_dim(d) for d in (16, 64, 80, 128, 256)] == [9, 36, 45, 72, 144]
    for bad in (0, 8, 72, -16):
        with pytest.raises(ValueError, match=f"head_size={bad}"):
            nvfp4_row_dim(bad)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None])
def test_cache_shape_rejects_bad_sizes(bad):
    spec = KVCacheConfig().layer_spec("model.layers.0.attn", 2, 64)
    with pytest.raises(ValueError, match="num_blocks"):
        spec.cache_shape(bad, 16)
    with pytest.raises(ValueError, match="block_size"):
        spec.cache_shape(4, bad)


@pytest.mark.parametrize("name", ["auto", "float32", "fp8", "fp8_e5m2", "nvfp4"])
def test_allocate_kv_cache(name):
    spec = KVCacheConfig(name).layer_spec("model.layers.0.attn", 2, 64, model_dtype=torch.float16)
    cache = allocate_kv_cache(spec, 3, 16, device="cpu")
    assert cache.shape == spec.cache_shape(3, 16)
    assert cache.dtype == spec.kv_cache_torch_dtype
    assert cache.is_contiguous() and cache.device.type == "cpu"
    assert not cache.view(torch.uint8).any(), "a fresh cache must be zero-filled, never stale memory"


# ----------------------------------------------------------------------------- NVFP4 numerics

# (input relative to a unit block scale, expected decoded magnitude): the RNE table of E2M1.
E2M1_CASES = [
    (0.0, 0.0), (0.1, 0.0), (0.25, 0.0), (0.26, 0.5), (0.5, 0.5), (0.74, 0.5), (0.75, 1.0), (1.0, 1.0),
    (1.25, 1.0), (1.26, 1.5), (1.5, 1.5), (1.74, 1.5), (1.75, 2.0), (2.0, 2.0), (2.5, 2.0), (2.51, 3.0),
    (3.0, 3.0), (3.49, 3.0), (3.5, 4.0), (4.0, 4.0), (5.0, 4.0), (5.01, 6.0), (6.0, 6.0),
]


def _nvfp4_block_with(values):
    """A 16-element block whose amax is 6 so the block scale is exactly 1.0 (global scale 1)."""
    block = torch.zeros(16)
    block[0] = 6.0
    block[1 : 1 + len(values)] = torch.tensor(values, dtype=torch.float32)
    return block


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_e2m1_round_to_nearest_even_table(sign):
    values = [sign * v for v, _ in E2M1_CASES]
    got = []
    for chunk in range(0, len(values), 15):
        part = values[chunk : chunk + 15]
        rows = nvfp4_quantize_reference(_nvfp4_block_with(part), 1.0)
        assert nvfp4_split(rows)[1].float().item() == 1.0
        got += nvfp4_dequantize_reference(rows, 1.0)[1 : 1 + len(part)].tolist()
    expected = [sign * e for _, e in E2M1_CASES]
    assert got == expected


def test_e2m1_ties_pick_even_codes():
    # Each tie sits between two codes; the even one (mantissa bit 0) wins.
    ties = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}
    for value, code in ties.items():
        for sign in (1, -1):
            data, _ = nvfp4_split(nvfp4_quantize_reference(_nvfp4_block_with([0.0, sign * value]), 1.0))
            got = (data[1] & 0xF).item()  # element 2: low nibble of byte 1
            expected = code | (8 if sign < 0 else 0)  # the sign bit survives rounding to zero
            assert got == expected, (value, sign, got, expected)


def test_e2m1_saturates_at_six():
    # Block scales clamp at 448 (e4m3 max), so values beyond 6 * 448 * gs saturate to +-6 codes.
    x = torch.tensor([1e9, -1e9, float("inf"), float("-inf")] + [0.0] * 12)
    decoded = nvfp4_dequantize_reference(nvfp4_quantize_reference(x, 1.0), 1.0)
    assert decoded[:4].tolist() == [6 * 448.0, -6 * 448.0, 6 * 448.0, -6 * 448.0]
    # With a block scale of 1, inputs between 6 and 6 * 1.0625 (where the scale would round) saturate.
    block = _nvfp4_block_with([])
    block[0] = 6.2
    rows = nvfp4_quantize_reference(block, 1.0)
    assert nvfp4_split(rows)[1].float().item() == 1.0
    assert nvfp4_dequantize_reference(rows, 1.0)[0].item() == 6.0


def test_nvfp4_nibble_order_and_scale_position():
    # Elements 0..15 = codes 0..7 then their negatives; scale 1 (amax 6).
    mags = list(E2M1_VALUES)
    x = torch.tensor(mags + [-m for m in mags], dtype=torch.float32)
    x[8] = -0.0  # code 8 (negative zero) decodes to 0
    rows = nvfp4_quantize_reference(x, 1.0)
    assert rows.dtype == torch.uint8 and rows.shape == (9,)
    codes = list(range(8)) + [0] + list(range(9, 16))  # -0.0 is not < 0, so it encodes as +0
    expected_bytes = [codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(8)]
    assert rows[:8].tolist() == expected_bytes  # even element in the low nibble
    assert rows[8].item() == torch.tensor(1.0).to(torch.float8_e4m3fn).view(torch.uint8).item()  # 0x38
    data, scales = nvfp4_split(rows)
    assert data.data_ptr() == rows.data_ptr() and scales.dtype == torch.float8_e4m3fn
    assert scales.data_ptr() == rows.data_ptr() + 8  # scales come after the data


def test_nvfp4_scale_layout_for_several_blocks():
    head_size = 64
    x = torch.zeros(2, 3, head_size)
    for b in range(head_size // 16):
        x[..., b * 16] = 6.0 * 2.0 ** b  # block b scale = 2**b
    rows = nvfp4_quantize_reference(x, 1.0)
    assert rows.shape == (2, 3, 36)
    scales = rows[..., 32:].view(torch.float8_e4m3fn).float()
    assert torch.equal(scales, torch.tensor([1.0, 2.0, 4.0, 8.0]).expand(2, 3, 4))


def test_nvfp4_nan_encodes_as_zero_without_poisoning_its_block():
    x = torch.tensor([float("nan"), 3.0, -1.5] + [0.0] * 13)
    decoded = nvfp4_dequantize_reference(nvfp4_quantize_reference(x, 1.0), 1.0)
    assert not torch.isnan(decoded).any()
    assert decoded[0].item() == 0.0
    torch.testing.assert_close(decoded[1:3], torch.tensor([3.0, -1.5]))


@pytest.mark.parametrize("head_size", [16, 64, 128, 256])
@pytest.mark.parametrize("global_scale", [1.0, 0.02, 7.5])
def test_nvfp4_roundtrip_error_bound(head_size, global_scale):
    torch.manual_seed(head_size)
    x = torch.randn(37, 2, head_size) * 3 * global_scale
    rows = nvfp4_quantize_reference(x.bfloat16(), torch.tensor(global_scale))
    decoded = nvfp4_dequantize_reference(rows, torch.tensor(global_scale))
    xb = x.bfloat16().float().reshape(37, 2, head_size // 16, 16)
    amax = xb.abs().amax(-1, keepdim=True)
    err = (decoded.reshape_as(xb) - xb).abs()
    # E2M1 spacing is at most 2 per unit scale (between 4 and 6); the scale itself rounds by <= 1/16.
    # So |err| <= half a step (1 * s) with s <= amax / 6 * (1 + 1/16).
    bound = amax / 6 * (1 + 1 / 16) * 1.0 + 1e-6
    assert (err <= bound).all()
    rel = (decoded - x.bfloat16().float()).norm() / x.bfloat16().float().norm()
    assert rel < 0.12


# ----------------------------------------------------------------------------- FP8 numerics


@pytest.mark.parametrize("name,torch_dtype,limit", [("fp8_e4m3", torch.float8_e4m3fn, 448.0),
                                                    ("fp8_e5m2", torch.float8_e5m2, 57344.0)])
def test_fp8_saturation_nan_and_rne(name, torch_dtype, limit):
    mode = parse_kv_cache_dtype(name)
    assert fp8_max(mode) == limit == torch.finfo(torch_dtype).max
    x = torch.tensor([1e6, -1e6, float("inf"), float("-inf"), float("nan"), limit * 1.01, 0.0, -0.0],
                     dtype=torch.float32).reshape(8, 1, 1)
    rows = reference.encode_kv(x, torch.tensor(1.0), mode, torch_dtype)
    got = rows.float().flatten()
    assert got[:4].tolist() == [limit, -limit, limit, -limit]
    assert torch.isnan(got[4])
    assert got[5].item() == limit
    assert got[6:].tolist() == [0.0, 0.0]
    # With a scale: x / scale is what is stored.
    scale = torch.tensor(0.5)
    y = torch.linspace(-3, 3, 97).reshape(97, 1, 1)
    rows = reference.encode_kv(y, scale, mode, torch_dtype)
    assert torch.equal(rows.float(), (y / 0.5).to(torch_dtype).float())
    decoded = reference.decode_rows(rows, scale, mode)
    rel_step = 2.0 ** -(3 if torch_dtype == torch.float8_e4m3fn else 2)
    assert ((decoded - y).abs() <= y.abs() * rel_step / 2 + 2.0 ** -9).all()


@pytest.mark.parametrize("torch_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_nan_byte_is_the_inputs_sign_whatever_the_arithmetic_returned(torch_dtype):
    """CUDA arithmetic turns any NaN into +NaN; the reference's byte must not depend on that."""
    from kvfuse.kv_cache import fp8_keep_nan_sign, fp8_per_token_head_quantize_reference

    # bf16 bits: +NaN at index 0, -NaN at index 4 (built from bits: conversions may flip a NaN's sign).
    bits = torch.tensor([0x7FC0, 0x3F80, 0x4000, 0x3F00, 0xFFC0 - 0x10000, 0xBF80 - 0x10000, 0xC000 - 0x10000,
                         0xBF00 - 0x10000], dtype=torch.int16)
    x = bits.view(torch.bfloat16)
    assert torch.signbit(x[4]) and not torch.signbit(x[0]) and x[1].item() == 1.0 and x[7].item() == -0.5
    # What CUDA hands over: x's values with both NaNs positive.
    canonical = torch.tensor([float("nan"), 1.0, 2.0, 0.5] * 2).abs()
    canonical[5:] = -canonical[5:]
    fixed = fp8_keep_nan_sign(canonical.to(torch_dtype), x).view(torch.uint8)
    assert fixed[0].item() == 0x7F and fixed[4].item() == 0xFF
    assert torch.equal(fixed[[1, 2, 3, 5, 6, 7]], canonical.to(torch_dtype).view(torch.uint8)[[1, 2, 3, 5, 6, 7]])
    # The references apply it: a -NaN input gives 0xFF for per-tensor, per-head and per-token-head FP8.
    rows = reference.encode_kv(x.reshape(2, 1, 4), torch.tensor([1.0]), 1 if torch_dtype == torch.float8_e4m3fn
                               else 2, torch_dtype)
    assert rows.view(torch.uint8)[1, 0, 0].item() == 0xFF and rows.view(torch.uint8)[0, 0, 0].item() == 0x7F
    if torch_dtype == torch.float8_e4m3fn:
        pth = fp8_per_token_head_quantize_reference(x.reshape(2, 1, 4))
        assert pth[1, 0, 0].item() == 0xFF and pth[0, 0, 0].item() == 0x7F


def test_fp8_rounding_is_nearest_even():
    # e4m3 around 1: spacing 1/8. 1 + 1/16 is a tie -> 1 (even); 1 + 3/16 -> 1.25 (even).
    x = torch.tensor([1 + 1 / 16, 1 + 3 / 16, 1 + 1 / 16 + 1e-3]).reshape(3, 1, 1)
    rows = reference.encode_kv(x, torch.tensor(1.0), KVQuantMode.FP8_E4M3, torch.float8_e4m3fn)
    assert rows.float().flatten().tolist() == [1.0, 1.25, 1.125]


def test_native_encode_converts_values_never_bits():
    x = torch.randn(5, 2, 64, dtype=torch.bfloat16)
    rows = reference.encode_kv(x, torch.tensor(1.0), KVQuantMode.NONE, torch.float16)
    assert rows.dtype == torch.float16
    assert torch.equal(rows.float(), x.float())
    # An op output never aliases its input, even when no conversion is needed.
    same = reference.encode_kv(x, torch.tensor(1.0), KVQuantMode.NONE, torch.bfloat16)
    assert torch.equal(same, x) and same.data_ptr() != x.data_ptr()


def test_public_api_names():
    for name in ("KVQuantMode", "parse_kv_cache_dtype", "KVCacheConfig", "KVCacheSpec", "allocate_kv_cache",
                 "PagedAttention", "AttentionMetadata", "backend", "make_backend"):
        assert hasattr(kvfuse, name), name
    assert math.isclose(0.28125, 9 / 32)
    assert list(itertools.islice(E2M1_VALUES, 8)) == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
