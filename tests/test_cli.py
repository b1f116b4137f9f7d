"""``python -m kvfuse``: explain, demo, info and bench."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfuse.__main__ import main

ROOT = Path(__file__).resolve().parent.parent


def _rows(text):
    """Table rows (after the dashed rule) split into columns on runs of 2+ spaces."""
    import re

    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("-----")) + 1
    rows = []
    for line in lines[start:]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def test_explain_known_config(capsys):
    rc = main(["explain", "--kv-cache-dtype", "fp8", "--skip-layers", "0,sliding_window,model.layers.3.self_attn.attn",
               "--checkpoint-kv-cache-dtype", "nvfp4", "--layers", "5", "--sliding-window-layers", "2",
               "--sliding-window", "1024", "--kv-heads", "8", "--head-size", "128"])
    out = capsys.readouterr().out
    assert rc == 0
    assert _rows(out) == [
        ["0", "model.layers.0.self_attn.attn", "-", "NONE", "bfloat16", "4096", "skip rule '0' (layer index 0)"],
        ["1", "model.layers.1.self_attn.attn", "-", "FP8_E4M3", "float8_e4m3fn", "2048", "explicit kv_cache_dtype='fp8'"],
        ["2", "model.layers.2.self_attn.attn", "1024", "NONE", "bfloat16", "4096",
         "skip rule 'sliding_window' (sliding window 1024)"],
        ["3", "model.layers.3.self_attn.attn", "-", "NONE", "bfloat16", "4096",
         "skip rule 'model.layers.3.self_attn.attn' (layer name)"],
        ["4", "model.layers.4.self_attn.attn", "-", "FP8_E4M3", "float8_e4m3fn", "2048", "explicit kv_cache_dtype='fp8'"],
    ]
    assert "cache: 16384 bytes/token over 5 layers, 80.0% of an all-bfloat16 cache (20480 bytes/token)" in out


def test_explain_checkpoint_and_auto(capsys):
    assert main(["explain", "--checkpoint-kv-cache-dtype", "nvfp4", "--layers", "2", "--skip-layers", "1",
                 "--model-dtype", "half", "--kv-heads", "2", "--head-size", "64"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows[0][3:] == ["NVFP4", "uint8", "144", "checkpoint declares 'nvfp4'"]
    assert rows[1][3:] == ["NONE", "float16", "512", "skip rule '1' (layer index 1)"]
    assert main(["explain", "--layers", "1"]) == 0
    assert _rows(capsys.readouterr().out)[0][3:] == ["NONE", "bfloat16", "4096", "auto: model dtype"]


@pytest.mark.parametrize("argv,message", [
    (["--kv-cache-dtype", "fp9"], "kv_cache_dtype='fp9' is not a KV-cache dtype; valid names are 'auto'"),
    (["--skip-layers", "sliding-window"], "did you mean 'sliding_window'"),
    (["--model-dtype", "fp8"], "--model-dtype='fp8' must name a native dtype"),
    (["--sliding-window-layers", "1,9"], "--sliding-window-layers holds [9], outside 0..3"),
    (["--sliding-window-layers", "x"], "must be a comma-separated list of integers"),
    (["--kv-cache-dtype", "nvfp4", "--head-size", "72"], "head_size=72 cannot be stored as NVFP4"),
])
def test_explain_errors(capsys, argv, message):
    assert main(["explain", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvfuse explain: error:") and message in err


def test_demo_nvfp4_in_process(capsys):
    rc = main(["demo", "--kv-cache-dtype", "nvfp4", "--layers", "2", "--hidden", "32", "--heads", "2",
               "--kv-heads", "1", "--head-size", "16", "--vocab", "64", "--prompt-lens", "5,3", "--steps", "2",
               "--device", "cpu", "--no-compile"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = _rows(out)
    assert [r[3] for r in rows] == ["NONE", "NONE"]  # defaults: skip 0 and the sliding-window layer (layers // 2 = 1)
    assert "logits vs an all-bfloat16 cache: relative error 0.000e+00" in out
    rc = main(["demo", "--kv-cache-dtype", "nvfp4", "--skip-layers", "", "--layers", "2", "--hidden", "32",
               "--heads", "2", "--kv-heads", "1", "--head-size", "16", "--vocab", "64", "--prompt-lens", "5,3",
               "--steps", "2", "--device", "cpu", "--no-compile"])
    out = capsys.readouterr().out
    assert rc == 0 and [r[3] for r in _rows(out)] == ["NVFP4", "NVFP4"]
    line = next(line for line in out.splitlines() if line.startswith("logits vs"))
    assert "relative error 0.000e+00" not in line and "top-1 agreement" in line


def test_demo_end_to_end_subprocess(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-m", "kvfuse", "demo", "--layers", "2", "--hidden", "32", "--heads", "2", "--kv-heads", "1",
         "--head-size", "16", "--vocab", "64", "--prompt-lens", "6,3", "--steps", "2", "--device", "cpu"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "model.layers.0.self_attn.attn" in out and "skip rule '0' (layer index 0)" in out
    assert "logits vs an all-bfloat16 cache: relative error" in out
    assert "compiled vs eager logits: relative error" in out


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch " in out and "python " in out and "depyf " in out
    assert "kernel registry on cpu" in out
    rows = _rows(out.split("kernel registry on cpu")[1].split("passed over:")[0])
    from kvfuse.ops import registry

    assert len(rows) == 5 * 4 == len(registry.OPS) * 4  # 5 ops x 4 modes, one situation each on CPU
    # Exactly the registry's decisions.

    expected = [(d["op"], d["mode"], d["chosen"]) for d in registry.decisions("cpu")]
    assert [(r[0], r[1], r[3]) for r in rows] == expected, rows
    assert all(name for _, _, name in expected)


def test_bench_reports_missing_benchmark(capsys):
    assert main(["bench", "no-such-benchmark", "--iters", "3"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark 'no-such-benchmark'" in err and "no_such_benchmark.py" in err and "available:" in err


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("explain", "demo", "info", "bench"):
        assert command in out
