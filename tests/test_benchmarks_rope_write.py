"""The rotary-write benchmark's command line (CPU: the benchmark itself needs a GPU)."""

import pytest

from benchmarks import rope_write


def test_default_variants_parse_even_though_names_hold_commas(monkeypatch, capsys):
    # Parsing happens before the CUDA check: a bad list fails with a usage error (exit 2 from
    # argparse), a good one reaches the check, which returns 2 with its own message on CPU.
    assert rope_write.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert rope_write.main(["--variants", "write; rotate_k, write", "--tokens", "16"]) == 2
    with pytest.raises(SystemExit):
        rope_write.main(["--variants", "write,rotate_k"])
    assert "unknown formats or variants ['write,rotate_k']" in capsys.readouterr().err
