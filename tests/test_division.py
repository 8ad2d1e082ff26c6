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

from lossscale_jax import _division
from lossscale_jax._state import RECENT_STEPS
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
