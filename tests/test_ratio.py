"""fairseq's ``overflows / float(iterations) >= tolerance``, decided exactly under jit.

Reference: Python itself (``int / float`` in float64, then ``>=``), on random counts, on the
counts nearest the threshold (``round(t * r) + {-1, 0, 1}``) for denominators up to
``2**31 - 1``, and on the extremes. The Farey neighbours are checked against a brute-force
search. The near-threshold counts are where a float32 comparison goes wrong, and the last
test shows it does on these very inputs, so the first can fail where it claims to guard.
"""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lossscale_jax.engine._ratio import MAX_COUNT, RatioThreshold, _neighbours

THRESHOLDS = [
    0.1,
    0.05,
    0.25,
    1 / 3,
    0.3,
    0.7,
    2 / 3,
    1.0,
    1.5,
    3.0,
    0.123456789,
    1e-9,
    5e-324,
    1e10,
    0.0,
    -1.0,
]


def counts(t: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    num = [rng.integers(0, 60, 2000), rng.integers(0, MAX_COUNT, 1000), [MAX_COUNT, 1, 0, 1]]
    den = [rng.integers(1, 60, 2000), rng.integers(1, MAX_COUNT, 1000), [1, MAX_COUNT, 5, 10]]
    if 0 < t < 1e9:
        r = rng.integers(1, MAX_COUNT, 2000)
        near = np.round(t * r).astype(np.int64)[:, None] + np.array([-1, 0, 1])
        num.append(np.clip(near, 0, MAX_COUNT).ravel())
        den.append(np.repeat(r, 3))
    return (np.concatenate(num).astype(np.int32), np.concatenate(den).astype(np.int32))


def python(num: np.ndarray, den: np.ndarray, t: float) -> np.ndarray:
    return np.array([int(a) / float(int(b)) >= t for a, b in zip(num, den, strict=True)])


@pytest.mark.parametrize("t", THRESHOLDS)
def test_at_least_is_pythons_float64_comparison(t):
    num, den = counts(t)
    ratio = RatioThreshold(t)
    got = np.asarray(jax.jit(ratio.at_least)(jnp.asarray(num), jnp.asarray(den)))
    want = python(num, den, t)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(int(num[i]), int(den[i])) for i in bad[:5]]


def test_the_float64_tie_backs_off():
    """1 / 10 is below the float64 0.1, but rounds to it: >= holds in Python, and here."""
    assert 1 / 10.0 >= 0.1 and Fraction(1, 10) < Fraction(0.1)
    assert bool(RatioThreshold(0.1).at_least(jnp.int32(1), jnp.int32(10)))
    assert 1 / 3.0 >= 1 / 3 and bool(RatioThreshold(1 / 3).at_least(jnp.int32(1), jnp.int32(3)))
    assert not bool(RatioThreshold(0.1).at_least(jnp.int32(1), jnp.int32(11)))


@pytest.mark.parametrize(
    "x", [Fraction(3, 7) + Fraction(1, 1000), Fraction(0.1), Fraction(22, 7) + Fraction(1, 997)]
)
@pytest.mark.parametrize("n", [5, 17, 60])
def test_neighbours_are_the_nearest_fractions(x, n):
    lo, hi = _neighbours(x, n)
    fractions = {Fraction(a, b) for b in range(1, n + 1) for a in range(0, 5 * b)}
    assert lo == max(f for f in fractions if f < x)
    assert hi == min(f for f in fractions if f > x)


def test_a_float32_comparison_fails_on_these_counts():
    """The naive rule, ``float32(num) / float32(den) >= float32(t)``, disagrees with Python
    on the near-threshold counts: the inputs above can tell the two apart."""
    wrong = 0
    for t in [0.1, 1 / 3, 0.123456789, 0.7]:
        num, den = counts(t)
        naive = (num.astype(np.float32) / den.astype(np.float32)) >= np.float32(t)
        wrong += int(np.sum(naive != python(num, den, t)))
    assert wrong > 0


def test_a_non_finite_threshold_is_refused():
    with pytest.raises(ValueError, match="threshold must be a finite number"):
        RatioThreshold(float("nan"))
