"""The state's rates divide by a step count, rounded once on every backend.

Reference: NumPy's float32 division (IEEE, one rounding). XLA:CPU divides the same way, so
the backend's own quotient would pass the first test here; the second hands the correction
quotients one and two ulps off, as XLA:GPU's approximate division gives (3 / 7 came out
0.42857146 there, not 0.42857143), and that is where a missing correction fails.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from lossscale_jax.engine import _division
from lossscale_jax.engine._state import RECENT_STEPS
from lossscale_jax.policies._tolerant import MAX_COUNT


def operands():
    rng = np.random.default_rng(0)
    n = rng.integers(1, _division.MAX_COUNT + 1, size=4000).astype(np.float32)
    counts = rng.integers(0, 4096, size=2000).astype(np.float32)
    reals = (rng.standard_normal(2000) * 10.0 ** rng.integers(-20, 5, 2000)).astype(np.float32)
    a = np.concatenate([counts, reals])
    a[:8], n[:8] = [3, 1, 2, 5, 1, 0, 7, 1999], [7, 3, 3, 2000, 2000, 9, 7, 2000]
    return a, n


def test_divide_by_count_is_numpys_division():
    a, n = operands()
    got = np.asarray(jax.jit(_division.divide_by_count)(a, n))
    want = (a / n).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert float(_division.divide_by_count(np.float32(3), 7)) == float(np.float32(3) / 7)


@pytest.mark.parametrize("ulps", [-2, -1, 1, 2])
def test_a_quotient_ulps_off_is_corrected(ulps):
    a, n = operands()
    keep = np.abs(a) > 0  # 0 / n is 0 on every backend
    a, n = a[keep], n[keep]
    want = (a / n).astype(np.float32)
    off = want.copy()
    for _ in range(abs(ulps)):
        off = np.nextafter(off, np.float32(np.inf * ulps)).astype(np.float32)
    assert not np.array_equal(off, want)
    got = np.asarray(jax.jit(_division.correct_quotient)(a, n, off))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_the_rates_divisors_fit():
    assert RECENT_STEPS <= _division.MAX_COUNT
    assert MAX_COUNT == _division.MAX_COUNT


def count_pairs():
    """Step counts as the state holds them: int32, any size, ``overflows <= steps``."""
    rng = np.random.default_rng(1)
    steps = np.concatenate(
        [
            rng.integers(1, 5000, 3000),
            rng.integers(1, 2**31 - 1, 3000),
            2 ** rng.integers(0, 31, 200),
            [1, 2, 3, 7, 2**24 - 1, 2**24, 2**24 + 1, 2**31 - 1, 2**31 - 1],
        ]
    ).astype(np.int32)
    overflows = (rng.random(steps.size) * (steps.astype(np.float64) + 1)).astype(np.int64)
    overflows = np.minimum(overflows, steps).astype(np.int32)
    overflows[-9:] = [1, 1, 3, 3, 2**24 - 3, 2**24 - 1, 2**23 + 1, 2**31 - 1, 2**30 + 1]
    overflows[:10] = 0
    overflows[10:20] = steps[10:20]  # a rate of 1
    return overflows, steps


def test_ratio_of_counts_is_numpys_float32_division():
    a, n = count_pairs()
    got = np.asarray(jax.jit(_division.ratio_of_counts)(a, n))
    want = (a.astype(np.float32) / n.astype(np.float32)).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert got.dtype == np.float32
    # 3 / 7: the quotient XLA:GPU's approximate division gave one ulp high (0.42857146)
    assert float(_division.ratio_of_counts(np.int32(3), np.int32(7))) == float(
        np.float32(3) / np.float32(7)
    )


def test_ratio_of_counts_rounds_both_ways():
    # The pairs above take both of the rounding's paths: quotients rounded up (the bit after
    # the 24th is set) and truncated, each many times, so neither path goes untested.
    a, n = count_pairs()
    keep = (a > 0) & (a < n)
    a, n = a[keep].astype(np.float64), n[keep].astype(np.float64)
    a32, n32 = a.astype(np.float32).astype(np.float64), n.astype(np.float32).astype(np.float64)
    exact = a32 / n32  # float64: 53 bits, enough to tell which way 24 bits were rounded
    got = np.asarray(_division.ratio_of_counts(a.astype(np.int32), n.astype(np.int32)))
    up = got.astype(np.float64) > exact
    assert up.sum() > 100 and (~up).sum() > 100


@pytest.mark.parametrize("ulps", [-2, -1, 1, 2])
def test_the_skew_hook_moves_the_quotient_and_the_correction_undoes_it(ulps, monkeypatch):
    a, n = operands()
    want = (a / n).astype(np.float32)
    with _division.skewed(ulps):
        got = np.asarray(jax.jit(_division.divide_by_count)(a, n))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # The hook does move the quotient: with the last correction left out, what the division
    # gives is the rounded quotient moved `ulps` ulps (but below TINY, 0 among them), on every
    # backend (the hook moves the rounded quotient, not the backend's own, which a GPU may
    # give two ulps off).
    real, calls = _division.correct_quotient, []

    def first_only(a, n, q):
        calls.append(q)
        return real(a, n, q) if len(calls) == 1 else q

    monkeypatch.setattr(_division, "correct_quotient", first_only)
    with _division.skewed(ulps):
        raw = np.asarray(jax.jit(lambda a, n: _division.divide_by_count(a, n))(a, n))  # afresh
    assert len(calls) == 2
    moved = np.abs(want) >= _division.TINY
    expected = want.copy()
    for _ in range(abs(ulps)):
        expected = np.nextafter(expected, np.float32(np.inf if ulps > 0 else -np.inf))
    expected = np.where(moved, expected, want)
    np.testing.assert_array_equal(raw.view(np.uint32), expected.view(np.uint32))
    assert np.all(raw[moved] != want[moved])


@pytest.mark.parametrize("bad", [3, -3, 1.0, True, "1"])
def test_the_skew_hook_refuses_what_the_correction_cannot_take(bad):
    with pytest.raises(ValueError, match="ulps must be an int from -2 to 2"):
        with _division.skewed(bad):
            pass
