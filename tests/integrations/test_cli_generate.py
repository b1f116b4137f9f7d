"""``python -m kvfuse generate``: offline, tiny models, plan + throughput + fusion report."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")

from kvfuse.__main__ import main  # noqa: E402

from _hf_models import build  # noqa: E402


def _plan_rows(out):
    return [line.split()[:4] for line in out.splitlines() if re.match(r"^\d+\s+model\.layers\.", line)]


def test_generate_tiny_config_eager(capsys):
    rc = main(["generate", "--model", "gemma3", "--batch", "2", "--prompt-len", "5", "--max-new-tokens", "3"])
    out = capsys.readouterr().out
    assert rc == 0
    # Gemma 3: five local (window 64) layers, then one global; the local ones are skipped.
    assert _plan_rows(out) == [[str(i), f"model.layers.{i}.self_attn.attn", "64", "NONE"] for i in range(5)] + [
        ["5", "model.layers.5.self_attn.attn", "-", "FP8_E4M3"]]
    assert re.search(r"generated 3 tokens x 2 sequences in [\d.]+ s: [\d.]+ tokens/s \(eager", out)
    assert "fusion report" not in out


def test_generate_local_directory_compiled(tmp_path, capsys):
    build("llama").save_pretrained(tmp_path)
    rc = main(["generate", "--model", str(tmp_path), "--kv-cache-dtype", "fp8", "--skip-layers", "0",
               "--batch", "2", "--prompt-len", "4", "--max-new-tokens", "2", "--compile"])
    out = capsys.readouterr().out
    assert rc == 0
    assert _plan_rows(out) == [["0", "model.layers.0.self_attn.attn", "-", "NONE"],
                               ["1", "model.layers.1.self_attn.attn", "-", "FP8_E4M3"]]
    assert "(compiled" in out
    report = out.split("fusion report (last compiled graph):")[1]
    assert re.search(r"model\.layers\.0\.self_attn\.attn\s+NONE\s+True", report)
    assert re.search(r"model\.layers\.1\.self_attn\.attn\s+FP8_E4M3\s+True", report)


def test_generate_bad_arguments(capsys):
    assert main(["generate", "--model", "no-such-arch"]) == 2
    assert "--model='no-such-arch' is neither a local model directory nor one of" in capsys.readouterr().err
    assert main(["generate", "--batch", "0"]) == 2
    assert "--batch=0 must be positive" in capsys.readouterr().err
    assert main(["generate", "--kv-cache-dtype", "int3"]) == 2
    assert "int3" in capsys.readouterr().err
