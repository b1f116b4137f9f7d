"""Timing helpers of the GPU benchmarks: what can be checked without a GPU (the order and the
arithmetic of interleaved timing, on a simulated clock), and on the device, that real samples
come back per round."""

import pytest
import torch

from benchmarks import common


def test_interleaved_order_puts_every_name_in_every_place_once_per_cycle():
    names = ["write", "full", "bf16 half", "f32 half"]
    order = common.interleaved_order(names, 8)
    assert len(order) == 8 and all(sorted(r) == sorted(names) for r in order)
    for place in range(len(names)):
        assert sorted(r[place] for r in order[:4]) == sorted(names)
    assert order[4:] == order[:4]


@pytest.mark.parametrize("rounds, names, message", [
    (0, ["a"], "rounds=0: want at least 1"),
    (3, ["a", "b", "a"], "want each once"),
])
def test_interleaved_order_refuses_bad_arguments(rounds, names, message):
    with pytest.raises(ValueError, match=message):
        common.interleaved_order(names, rounds)


def _drifting_machine(monkeypatch, cost, step_after):
    """bench_interleaved over a simulated machine, no CUDA: variant ``name`` takes ``cost[name]``
    us per sample, times 1.0 for the first ``step_after`` samples of the run and 1.25 after (a
    level shift mid-run). Returns the log of sampled names."""
    log = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(common, "_capture", lambda calls: None)

    def sample(calls):
        name = calls[0]()
        log.append(name)
        return cost[name] * (1.0 if len(log) <= step_after else 1.25)

    monkeypatch.setattr(common, "_eager_sample", sample)
    return log


def test_interleaved_ratios_cancel_a_level_shift_that_separate_runs_would_keep(monkeypatch):
    cost = {"write": 1.0, "rope": 1.08}
    rounds = 9
    # The shift comes after 9 samples: in a one-by-one run it would land exactly between the
    # write's samples and the rotary write's, and their ratio would read 1.35.
    log = _drifting_machine(monkeypatch, cost, step_after=rounds)
    variants = {name: [lambda name=name: name] for name in cost}
    timed = common.bench_interleaved(variants, rounds=rounds)
    # one sample of each variant per round, in turn
    assert log == [name for order in common.interleaved_order(list(cost), rounds) for name in order]
    assert timed.graphed == {"write": False, "rope": False}
    assert [len(s) for s in timed.samples.values()] == [rounds, rounds]
    mid, lo, hi = timed.ratio("rope", "write")
    # every round but the one the shift splits sees the true ratio
    assert mid == pytest.approx(1.08)
    assert lo == pytest.approx(1.08)
    assert hi == pytest.approx(1.08 * 1.25)
    assert timed.median("write") == 1.0  # five of its nine samples came before the shift


def test_interleaved_timings_ratio_is_per_round():
    timed = common.InterleavedTimings({"a": [2.0, 4.0, 3.0], "b": [1.0, 2.0, 3.0]}, {"a": True, "b": True})
    assert timed.ratio("a", "b") == (2.0, 1.0, 2.0)
    assert timed.median("a") == 3.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_interleaved_samples_a_twice_as_long_call_about_twice_as_long():
    x = torch.randn(1 << 24, device="cuda")
    y = torch.empty_like(x)
    one = [lambda: y.copy_(x)]
    two = [lambda: (y.copy_(x), y.copy_(x))]
    timed = common.bench_interleaved({"one": one, "two": two}, rounds=6, min_ms=1.0)
    assert timed.graphed == {"one": True, "two": True}
    assert all(len(s) == 6 and min(s) > 0 for s in timed.samples.values())
    assert 1.7 < timed.ratio("two", "one")[0] < 2.3
