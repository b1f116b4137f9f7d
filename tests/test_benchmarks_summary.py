"""benchmarks.summary: the variant tables a GPU run's focus and variants phases leave behind."""

import json

from benchmarks import summary


def _attention(path, rows):
    path.mkdir()
    (path / "attention.json").write_text(json.dumps({"rows": rows}))


def _row(op, fmt, batch, context, us):
    return dict(op=op, kv_cache_dtype=fmt, batch=batch, context=context, impl="kvfuse", us=us)


def test_variant_lines_put_each_variant_beside_the_default(tmp_path):
    _attention(tmp_path / "attention_default", [_row("decode", "nvfp4", 64, 4096, 516.9),
                                                 _row("prefill", "bfloat16", 1, 4096, 538.2)])
    _attention(tmp_path / "attention_PREFETCH_PAGES=1", [_row("decode", "nvfp4", 64, 4096, 400.0)])
    (tmp_path / "attention_empty").mkdir()  # a variant whose run was cut before writing
    lines = summary.variant_lines(str(tmp_path))
    assert "default" in lines[1] and "PREFETCH_PAGES=1" in lines[1]
    decode = next(line for line in lines if line.startswith("decode nvfp4 64x4096"))
    assert decode.split()[-2:] == ["516.9", "400.0"]  # the default's column first
    prefill = next(line for line in lines if line.startswith("prefill bfloat16 1x4096"))
    assert prefill.split()[-2:] == ["538.2", "-"]


def test_no_variant_folders_no_lines(tmp_path):
    assert summary.variant_lines(str(tmp_path)) == []


def test_focus_lines_show_errors_and_fractions():
    data = {"copy_gb_s": 3011.0, "rows": [
        dict(variant="pth default", cache="fp8_pth", batch=64, context=4096, num_q_heads=32, us=731.1, frac_copy=0.25),
        dict(variant="pth uncapped", cache="fp8_pth", batch=64, context=4096, num_q_heads=32, error="OutOfResources")]}
    lines = summary.focus_lines(data)
    assert lines[1].endswith("731.1 (25%)") and "error: OutOfResources" in lines[2]


def test_run_gpu_focus_phase_names_existing_variants():
    """run_gpu.sh's focus phase selects variants by label: a label that matches none would be
    skipped silently on the GPU machine."""
    import os
    import re

    from benchmarks.attention import FOCUS_VARIANTS

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "benchmarks", "run_gpu.sh")) as f:
        selected = re.search(r'BENCH_FOCUS_ONLY:-"([^"]+)"', f.read()).group(1).split(",")
    labels = {variant[0] for variant in FOCUS_VARIANTS}
    assert selected and not [s for s in selected if s not in labels]
    assert all(variant[1] in ("bf16", "fp8", "nvfp4", "fp8_pth") for variant in FOCUS_VARIANTS)


def test_run_gpu_rope_native_phase_names_existing_rows_and_knobs():
    """The rope-native phase's benchmark rows exist in rope_write.VARIANTS (an unknown one ends the
    run on the GPU machine), and its default build variant sets knobs csrc/ still has (an unknown
    -D would build the default kernel under another name)."""
    import os
    import re

    from benchmarks.rope_write import VARIANTS

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "benchmarks", "run_gpu.sh")) as f:
        phase = f.read().split("rope-native)", 1)[1].split(";;", 1)[0]
    rows = re.search(r'--variants "([^"]+)"', phase).group(1).split(";")
    assert rows and not [r for r in rows if r not in VARIANTS]
    knobs = re.findall(r"-D(KVFUSE_[A-Z0-9_]+)=", re.search(r"ROPE_VARIANTS:-([^}]+)}", phase).group(1))
    with open(os.path.join(root, "csrc", "cuda", "cache_write.cu")) as f:
        source = f.read()
    assert knobs and all(f"#ifndef {k}" in source for k in knobs), knobs


def test_tile_fields_from_the_command_line():
    import pytest

    from benchmarks.common import tile_fields

    assert tile_fields(["WORD_SCALES=1", "MAXNREG=none", "BLOCK_N=128"]) == dict(
        WORD_SCALES=1, MAXNREG=None, BLOCK_N=128)
    with pytest.raises(ValueError, match=r"--tile 'WORDS=1': expected FIELD=VALUE with FIELD one of .*WORD_SCALES"):
        tile_fields(["WORDS=1"])
    with pytest.raises(ValueError, match=r"--tile 'PREFETCH_PAGES': expected FIELD=VALUE"):
        tile_fields(["PREFETCH_PAGES"])
    with pytest.raises(ValueError, match=r"--tile 'MAXNREG=lots': VALUE must be an integer"):
        tile_fields(["MAXNREG=lots"])
    assert tile_fields(["GRID_ORDER=heads"]) == dict(GRID_ORDER="heads")


def test_current_commit_marks_a_tree_that_is_not_its_head(tmp_path, monkeypatch):
    import subprocess

    from benchmarks.common import current_commit

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    (tmp_path / "kernel.cu").write_text("// one\n")
    git("add", "kernel.cu")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = git("rev-parse", "--short", "HEAD").strip()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    assert current_commit() == head
    (tmp_path / "notes.txt").write_text("untracked files are not measured code\n")
    assert current_commit() == head
    (tmp_path / "kernel.cu").write_text("// two\n")
    assert current_commit() == f"{head}+dirty"
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    assert current_commit() == "abc1234"


def test_rope_write_lines_show_the_goal_columns_with_their_ranges():
    """The rope phase's short table: the write alone, the fused key over both table forms and the
    fused query and key, each with its ratio (and per-round range where the run interleaved), and
    FlashInfer where it ran; variants a run did not time show as '-'."""
    interleaved = {"tokens": 4096, "format": "nvfp4", "write": 9.17, "rope_k+write": 10.54,
                   "rope_k+write / write": 1.152, "rope_k+write / write range": [1.142, 1.161],
                   "rope_k+write, f32 half tables": 10.17, "f32 half tables / write": 1.112,
                   "f32 half tables / write range": [1.104, 1.119], "rope_qk+write": 28.32,
                   "rope_qk+write / unfused": 0.827, "rope_qk+write / unfused range": [0.824, 0.831]}
    one_by_one = {"tokens": 64, "format": "fp8", "write": 1.07, "rope_k+write": 1.2,
                  "rope_k+write / write": 1.121, "flashinfer": 2.75}
    lines = summary.rope_write_lines({"rows": [interleaved, one_by_one]})
    assert "1.1" in lines[0]
    nvfp4 = lines[2].split()
    assert nvfp4[:5] == ["nvfp4", "4096", "9.17", "10.54", "1.152"] and "(1.142-1.161)" in nvfp4
    assert "10.17" in nvfp4 and "(1.104-1.119)" in nvfp4 and "28.32" in nvfp4 and nvfp4[-1] == "-"
    fp8 = lines[3].split()
    assert fp8 == ["fp8", "64", "1.07", "1.20", "1.121", "-", "-", "2.75"]


def test_main_prints_the_rope_table_from_a_run_directory(tmp_path, capsys):
    row = {"tokens": 64, "format": "bfloat16", "write": 1.11, "rope_k+write": 1.1, "rope_k+write / write": 0.991}
    (tmp_path / "rope_write.json").write_text(json.dumps({"info": {}, "rows": [row], "notes": []}))
    summary.main(str(tmp_path))
    out = capsys.readouterr().out
    assert "rotary write" in out and "bfloat16" in out and "0.991" in out
