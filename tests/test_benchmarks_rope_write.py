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


def test_rotating_sets_are_sized_by_the_key_and_value_bytes(monkeypatch):
    """Every variant reads K and V; the sets must exceed 2x L2 by those bytes alone (the query is
    read only by some variants), e.g. 7 sets of 4096 tokens on a 50 MiB L2."""
    from benchmarks import common

    assert rope_write.Case.bytes_per_call(4096) == 4096 * 2 * rope_write.HKV * rope_write.D * 2
    monkeypatch.setattr(common, "l2_bytes", lambda: 50 * 2 ** 20)
    sets = common.rotations_for(rope_write.Case.bytes_per_call(4096))
    assert sets == 7 and sets * rope_write.Case.bytes_per_call(4096) > 2 * 50 * 2 ** 20


@pytest.mark.parametrize("bad", ["0.5", "0.5,0.25,1", "0,1", "-1,1", "inf,1", "nan,1", "a,b", ""])
def test_scales_must_be_two_positive_finite_floats(capsys, bad):
    with pytest.raises(SystemExit):
        rope_write.main([f"--scales={bad}"])
    assert f"--scales {bad!r}: want two positive finite floats, K,V" in capsys.readouterr().err


def test_good_scales_reach_the_cuda_check(capsys):
    assert rope_write.main(["--scales", "0.37,0.29", "--tokens", "16"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert rope_write.DEFAULT_SCALES == (0.5, 0.25)


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "1"], "--rounds 1: want 0 (no interleaving) or at least 2 rounds"),
    (["--rounds", "-2"], "--rounds -2: want 0 (no interleaving) or at least 2 rounds"),
    (["--rounds", "4", "--sweep"], "--rounds times the variants, --sweep the launch configs"),
])
def test_rounds_are_refused_where_they_cannot_interleave(capsys, argv, message):
    with pytest.raises(SystemExit):
        rope_write.main(argv)
    assert message in capsys.readouterr().err


def test_interleaved_cells_show_the_per_round_range():
    row = {"write": 1.07, "rope_k+write / write": 1.081, "rope_k+write / write range": [1.05, 1.12], "x": None}
    assert rope_write._cell(row, "rope_k+write / write") == "1.081 (1.05-1.12)"
    assert rope_write._cell(row, "write") == "1.07"
    assert rope_write._cell(row, "x") == "-"
    assert rope_write._cell(row, "missing") == "-"
