"""Arithmetic of csrc/cuda/prefill_attention.cu that the CPU can check: poly_exp2, the e4m3
softmax's 2^x off the MUFU unit, emulated in float32 with the constants read from the kernel's
own source, against its stated relative error, and its behaviour down to -inf; and the bound that
keeps the e4m3 kernel's f16 scores finite.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "cuda" / "prefill_attention.cu"


def _poly_exp2_source() -> str:
    """poly_exp2's comment block and body."""
    text = SOURCE.read_text()
    start = text.index("__device__ __forceinline__ float poly_exp2(float x)")
    comment = text.rindex("\n\n", 0, start)
    return text[comment:text.index("\n}\n", start)]


def _constants():
    body = _poly_exp2_source()
    clamp = float(re.search(r"x = fmaxf\(x, (-?[0-9.]+)f\);", body).group(1))
    rounding = float(re.search(r"kRound = ([0-9.]+)f;", body).group(1))
    horner = re.search(r"fmaf\(fmaf\(fmaf\(([0-9.]+)f, f, ([0-9.]+)f\), f, ([0-9.]+)f\), f, ([0-9.]+)f\)", body)
    assert horner is not None, "poly_exp2 is no longer a degree-3 Horner form: update this test"
    return clamp, rounding, [np.float32(c) for c in horner.groups()]


def poly_exp2(x: np.ndarray) -> np.ndarray:
    """The kernel's steps in float32 (each fmaf as one rounding of the exact float64 value)."""
    clamp, rounding, coeffs = _constants()
    x = np.maximum(x.astype(np.float32), np.float32(clamp))
    t = (x + np.float32(rounding)).astype(np.float32)
    f = (x - (t - np.float32(rounding)).astype(np.float32)).astype(np.float32)
    p = np.full_like(f, coeffs[0])
    for c in coeffs[1:]:
        p = (p.astype(np.float64) * f.astype(np.float64) + np.float64(c)).astype(np.float32)
    bits = (p.view(np.uint32).astype(np.uint64) + (t.view(np.uint32).astype(np.uint64) << np.uint64(23)))
    return (bits & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.float32)


def test_relative_error_within_the_stated_bound():
    prose = " ".join(line.lstrip("/ ") for line in _poly_exp2_source().splitlines())
    stated = float(re.search(r"relative error < ([0-9.]+e-[0-9]+)", prose).group(1))
    rng = np.random.default_rng(0)
    # Every exponent the softmax produces: scores minus the row max plus the e4m3 shift of 8.
    x = np.concatenate([rng.uniform(-120.0, 8.0, 200_000), np.linspace(-1.0, 1.0, 20_001), [0.0, 8.0, -0.5, 0.5]])
    x = x.astype(np.float32)
    got = poly_exp2(x).astype(np.float64)
    rel = np.abs(got / np.exp2(x.astype(np.float64)) - 1.0)
    assert rel.max() < stated, rel.max()
    # Well inside e4m3's rounding of P (3 mantissa bits: relative steps of 2^-4).
    assert rel.max() < 2.0 ** -10


@pytest.mark.parametrize("x", [-np.inf, -1e30, -200.0, -126.5, -126.0, -125.5])
def test_underflow_stays_tiny_finite_and_non_negative(x):
    """Masked keys (-inf) and far-below-max scores: below 2^-125, zero once rounded to e4m3."""
    got = poly_exp2(np.array([x], dtype=np.float32))[0]
    assert np.isfinite(got) and 0.0 <= got < 2.0 ** -125


def test_f16_scores_hold_any_e4m3_keys():
    """The e4m3 kernel's S accumulates in f16: 128 products of a query scaled to at most
    kF16QueryMax with e4m3's largest key (448) must stay inside f16's largest finite value."""
    text = SOURCE.read_text()
    query_max = float(re.search(r"constexpr float kF16QueryMax = ([0-9.]+)f;", text).group(1))
    head = int(re.search(r"constexpr int kHead = ([0-9]+);", text).group(1))
    assert head * query_max * 448.0 <= 65504.0
    # Within a factor of two of it: a smaller bound would push one more binade of the query's
    # small elements below e4m3's normal range for nothing.
    assert head * query_max * 448.0 > 65504.0 / 2
