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

    assert len(rows) == 5 * 5 == len(registry.OPS) * 5  # 5 ops x 5 modes, one situation each on CPU
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


# ----------------------------------------------------------------------------- what a new user hit (issue 19)


def _one_line_error(capsys, command):
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvfuse {command}: error: "), captured.err
    assert "Traceback" not in captured.err
    return lines[0]


def test_bench_without_a_name_lists_the_benchmarks(capsys):
    assert main(["bench"]) == 2
    line = _one_line_error(capsys, "bench")
    for name in ("attention", "cache-write", "compile-pass", "decode-step"):
        assert name in line
    assert "common" not in line


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for hosts without CUDA")
@pytest.mark.parametrize("name", ["attention", "decode-step", "cache-write"])
def test_cuda_benchmarks_refuse_a_cpu_host_in_one_line(capsys, name):
    assert main(["bench", name]) == 2
    line = _one_line_error(capsys, "bench")
    runnable = [n.strip() for n in line.split("on this machine:")[1].split(",")]
    assert f"benchmark {name!r} needs a CUDA device" in line and "compile-pass" in runnable
    assert name not in runnable and "rope-write" not in runnable


def test_benchmark_plots_are_skipped_without_matplotlib(tmp_path, monkeypatch, capsys):
    import sys as _sys

    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setitem(_sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    from benchmarks import common, compile_pass

    common.plot_lines(str(tmp_path / "x.png"), {"p": {"a": [(1, 2.0), (2, 3.0)]}}, "t", "x", "y")
    result = {"date": "2024-01-01", "device": "cpu", "torch": "x", "commit": "c", "command": "cmd",
              "compile": [{"layers": 2, "fuse": f, "compile_s": 1.5, "pass_ms": 2.0} for f in (False, True)]}
    compile_pass.write_md_and_plot(result, str(tmp_path))
    assert (tmp_path / "compile_pass.md").read_text().count("| 2 | 1.50 | 1.50 |") == 1
    assert not (tmp_path / "compile_pass.png").exists() and not (tmp_path / "x.png").exists()
    err = capsys.readouterr().err
    assert "plot" in err and "skipped: matplotlib is not installed" in err


@pytest.mark.parametrize("argv,message", [
    (["--block-size", "0"], "--block-size=0 must be a positive integer"),
    (["--device", "gpu"], "--device='gpu' is not a device kvfuse runs on; allowed: 'cpu', 'cuda' or 'cuda:N'"),
    (["--device", "mps"], "--device='mps' is not a device kvfuse runs on"),
    (["--heads", "-2"], "--heads=-2 must be a positive integer"),
    (["--model-dtype", "float64"], "--model-dtype='float64' must name a native dtype"),
])
def test_demo_argument_errors_are_one_line(capsys, argv, message):
    assert main(["demo", "--no-compile", *argv]) == 2
    assert message in _one_line_error(capsys, "demo")


def test_model_dtype_error_lists_only_native_names(capsys):
    assert main(["explain", "--model-dtype", "float64"]) == 2
    line = _one_line_error(capsys, "explain")
    assert "'bfloat16'" in line and "'half'" in line
    for name in ("fp8", "nvfp4", "'auto'"):
        assert name not in line, line


def test_skip_rules_matching_no_layer_are_reported(capsys):
    assert main(["explain", "--kv-cache-dtype", "fp8", "--skip-layers", "7,layers.0,1"]) == 0
    out = capsys.readouterr().out
    (warning,) = [line for line in out.splitlines() if line.startswith("warning:")]
    assert "'7', 'layers.0' match no layer" in warning and "'model.layers.0.self_attn.attn'" in warning
    assert "indices 0..3" in warning
    assert main(["explain", "--skip-layers", "7", "--strict-skip-layers"]) == 2
    assert "'7' matches no layer" in _one_line_error(capsys, "explain")
    assert main(["explain", "--skip-layers", "1"]) == 0
    assert "warning" not in capsys.readouterr().out
    assert main(["demo", "--no-compile", "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1",
                 "--head-size", "16", "--vocab", "64", "--prompt-lens", "3", "--steps", "0", "--device", "cpu",
                 "--skip-layers", "model.layers.1.self_attn.attn", "--sliding-window-layers", ""]) == 0
    out = capsys.readouterr().out
    assert "warning: skip_layers rule 'model.layers.1.self_attn.attn' matches no layer" in out


def test_status_line_only_on_a_terminal(monkeypatch):
    import io

    from kvfuse import __main__ as cli

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, shown in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(cli.sys, "stderr", stream)
        with cli._status("compiling the model"):
            pass
        text = stream.getvalue()
        assert text == ("compiling the model...\r\033[K" if shown else ""), repr(text)


@pytest.mark.parametrize("value, verbose", [(None, False), ("1", True), ("off", False)])
def test_native_build_verbosity_is_a_setting_not_the_log_level(monkeypatch, tmp_path, capsys, value, verbose):
    # `-v` is for kvfuse's own decisions: the build's ninja / compiler lines follow
    # KVFUSE_NATIVE_VERBOSE only, whatever the log level.
    from torch.utils import cpp_extension

    from kvfuse import envs
    from kvfuse.ops import native

    seen = {}
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: seen.update(kwargs) or str(tmp_path / "lib.so"))
    monkeypatch.setenv("KVFUSE_NATIVE_BUILD_DIR", str(tmp_path))
    if value is None:
        monkeypatch.delenv("KVFUSE_NATIVE_VERBOSE", raising=False)
    else:
        monkeypatch.setenv("KVFUSE_NATIVE_VERBOSE", value)
    envs.reload()
    assert main(["-v", "explain", "--layers", "1"]) == 0
    native._compile(tmp_path, None)  # the build call itself is faked: only its arguments matter
    assert seen["verbose"] is verbose


def test_native_verbose_refuses_a_non_boolean(monkeypatch):
    from kvfuse import envs

    monkeypatch.setenv("KVFUSE_NATIVE_VERBOSE", "loud")
    with pytest.raises(ValueError, match=r"KVFUSE_NATIVE_VERBOSE='loud' is not a boolean"):
        envs.reload()


def test_numpy_is_a_dependency():
    # torch's compile stack imports numpy; without it every compile prints "Failed to initialize NumPy".
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "numpy" for d in deps), deps
