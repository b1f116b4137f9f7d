"""benchmarks/kv_accuracy.py: the KV-cache format accuracy table's core on tiny models (CPU)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import kv_accuracy as acc  # noqa: E402
from kvfuse.kv_cache import fp8_max, KVQuantMode  # noqa: E402

FP8_MAX = fp8_max(KVQuantMode.FP8_E4M3)


def _rows(result):
    return {row["format"]: row for row in result["rows"]}


def test_reference_is_exact_and_calibration_beats_scale_one_on_outliers():
    # Qwen3: the K outliers go through its k_norm gain (every KV head), past e4m3's 448 at scale 1.0.
    formats = [acc.FORMATS_BY_KEY[k] for k in ("bf16", "fp8", "fp8_cal")]
    result = acc.evaluate_model("qwen3", formats, steps=4)
    rows = _rows(result)
    assert rows["bf16"]["max_abs"] == 0 and rows["bf16"]["rel_l2"] == 0 and rows["bf16"]["top1"] == 1.0
    assert result["kv"]["k_max"] > FP8_MAX, "the recipe's K outliers exceed e4m3's range at scale 1.0"
    assert result["recipe_check"] < 1e-5, "the recipe must leave the model's function unchanged"
    fp8, cal = rows["fp8"], rows["fp8_cal"]
    assert 0 < cal["rel_l2"] < fp8["rel_l2"] and cal["max_abs"] < fp8["max_abs"], (cal, fp8)
    # Calibration maps the largest K seen on the calibration prompts to 448.
    assert cal["k_scale_max"] > 1.0 and "k_scale_max" not in fp8
    positions = int(acc.prompts(acc.EVAL_LENGTHS, acc.EVAL_SEED)[1].sum()) + 4 * len(acc.EVAL_LENGTHS)
    assert fp8["positions"] == positions and fp8["decode_positions"] == 4 * len(acc.EVAL_LENGTHS)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_outlier_recipe_keeps_the_function_and_puts_outliers_in_the_cache(name):
    # llama: projections (one KV head); gemma3: its (1 + w) k_norm/q_norm gains (every KV head).
    base = acc.build_model(name)
    model = acc.build_model(name)
    chosen = acc.add_kv_outliers(model, acc.OutlierRecipe())
    assert len(chosen) == model.config.num_hidden_layers
    d = model.config.head_dim
    for layer in chosen:
        pairs = [c for c in layer["k_channels"] if c < d // 2]
        assert sorted(pairs + [c + d // 2 for c in pairs]) == layer["k_channels"], "K outliers are rotary pairs"
        assert len(layer["v_channels"]) == 4
        assert (layer["k_head"] == "all") is (name == "gemma3")
    ids, mask = acc.prompts((11, 5), seed=3)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        want = base(input_ids=ids, attention_mask=mask, position_ids=pos).logits[mask.bool()]
        got = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[mask.bool()]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.equal(model.model.layers[0].self_attn.v_proj.weight, base.model.layers[0].self_attn.v_proj.weight)


def test_mixed_formats_are_rows_kvfuse_runs():
    for key in ("fp8k_nvfp4v_cal", "nvfp4k_fp8v_cal"):
        fmt = acc.FORMATS_BY_KEY[key]
        assert acc.unsupported_reason(fmt) is None
        spec = fmt.kv_config().layer_spec("model.layers.0.self_attn", 2, 32)
        assert spec.is_mixed
    assert acc.unsupported_reason(acc.FORMATS_BY_KEY["fp8"]) is None


def test_cli_writes_json(tmp_path, capsys):
    assert acc.main(["--models", "llama", "--formats", "bf16,fp8_token_head", "--steps", "2", "--outliers", "no",
                     "--out", str(tmp_path)]) == 0
    files = list(tmp_path.glob("kv_accuracy-*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    meta = data["meta"]
    assert meta["machine"] == "CPU" and meta["torch"] == torch.__version__ and meta["commit"]
    assert meta["command"].startswith("python -m benchmarks.kv_accuracy --models llama")
    (result,) = data["results"]
    assert result["model"] == "llama" and result["with_outliers"] is False and result["recipe_check"] is None
    rows = _rows(result)
    assert rows["bf16"]["rel_l2"] == 0
    token_head = rows["fp8_token_head"]
    assert "skipped" in token_head or token_head["rel_l2"] > 0, token_head
    out = capsys.readouterr().out
    assert "| llama | as built | bf16 (the reference, run again) | 0 | 0 | 100.0% |" in out


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="model='gpt2' is not one of"):
        acc.build_model("gpt2")
    with pytest.raises(ValueError, match="steps=0 must be an int >= 1"):
        acc.evaluate_model("llama", steps=0)
    with pytest.raises(ValueError, match="outlier=-1 must be a finite number > 0"):
        acc.OutlierRecipe(outlier=-1)
    with pytest.raises(SystemExit):
        acc.main(["--formats", "fp9"])
