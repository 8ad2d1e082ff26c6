"""Division by a step count, rounded once to float32 on every backend.

The state's rates (``recent_overflow_rate``, the tolerant policy's overflow ratio) divide by
a count of steps. IEEE division rounds once; XLA:GPU computes a float32 ``a / b`` with an
approximate reciprocal that can be an ulp off (3 / 7 gives 0.42857146, not 0.42857143), so
the same rule would give other bits on a GPU than on a CPU or in a NumPy reference model.
:func:`divide_by_count` takes the backend's quotient and corrects it: of the quotient and
its neighbours two ulps either way it keeps the one whose remainder ``a - q * n`` is the
smallest, computed exactly (ties to the even one, as IEEE rounds). Multiplications,
subtractions and conversions, which every backend rounds as IEEE says, are all it uses.

Why the remainder is exact: ``n`` is an integer below ``2**12`` and ``q`` is split into
``hi`` (its top 12 significant bits) and ``lo = q - hi`` (the rest, 12 bits at most), so
``hi * n`` and ``lo * n`` have at most 24 significant bits each and are exact in float32;
``a - hi * n`` subtracts two numbers within a factor of two of each other (Sterbenz's
lemma) and the last subtraction leaves a multiple of ``lo``'s unit smaller than ``2**24``
of them. A fused multiply-add a compiler may form from these gives the same exact values.

:func:`ratio_of_counts` divides two step counts of any size (``metrics``' overflow rate) with
integer operations alone: a long division, exact on every backend by construction.

:func:`skewed` is the test hook that moves the quotient by a few ulps before the correction
sees it, so a CPU run checks the correction XLA:GPU's approximate division needs. It moves the
correctly rounded quotient, not the backend's: on a GPU, whose quotient may already be off by
up to two ulps, the hook's skew would otherwise come on top of that error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lossscale_jax.engine._ops import where

MAX_COUNT = 2**12 - 1
"""The largest divisor :func:`divide_by_count` rounds exactly."""

TINY = 2.0**-100
"""Quotients smaller in magnitude are returned as the backend computed them."""

_HIGH_BITS = np.uint32(0xFFFFF000)  # sign, exponent and the top 12 of 24 significant bits

MAX_SKEW = 2
"""How many ulps :func:`skewed` may move the quotient (what the correction takes)."""

# A JAX user context: part of JAX's trace-cache key (as _skip's override), so a step traced with
# one skew is never reused with another; read while a step is traced.
_SKEW = jax.make_user_context(0)


@contextlib.contextmanager
def skewed(ulps: int) -> Iterator[None]:
    """Test hook: inside, :func:`divide_by_count` hands its correction the rounded quotient
    moved ``ulps`` units in the last place (``-MAX_SKEW`` to ``MAX_SKEW``), as an approximate
    division (XLA:GPU's) may give it; the result must not change. Read while a step is
    traced."""
    if not isinstance(ulps, int) or isinstance(ulps, bool) or abs(ulps) > MAX_SKEW:
        raise ValueError(f"ulps must be an int from {-MAX_SKEW} to {MAX_SKEW}, got {ulps!r}.")
    with _SKEW(ulps):
        yield


def _moved(q: jax.Array, ulps: int) -> jax.Array:
    """``q`` moved ``ulps`` ulps, but where the correction keeps it (below ``TINY``: 0 among
    them, which every backend's division gives exactly)."""
    toward = jnp.float32(np.inf if ulps > 0 else -np.inf)
    moved = q
    for _ in range(abs(ulps)):
        moved = jnp.nextafter(moved, toward)
    return where(jnp.abs(q) < TINY, q, moved)


def _remainder(a: jax.Array, q: jax.Array, n: jax.Array) -> jax.Array:
    """``a - q * n``, exactly (see the module's docstring)."""
    hi = lax.bitcast_convert_type(
        lax.bitwise_and(lax.bitcast_convert_type(q, jnp.uint32), _full(q, _HIGH_BITS, jnp.uint32)),
        jnp.float32,
    )
    lo = lax.sub(q, hi)
    return lax.sub(lax.sub(a, lax.mul(hi, n)), lax.mul(lo, n))


def _full(q: jax.Array, value: Any, dtype: Any) -> jax.Array:
    """``value`` in ``dtype``, of ``q``'s shape (``lax``'s operations take no broadcasting)."""
    return lax.full(jnp.shape(q), value, dtype)


def correct_quotient(a: jax.Array, n: jax.Array, q: jax.Array) -> jax.Array:
    """The float32 nearest ``a / n`` (ties to even), given ``q`` within two ulps of it.

    In ``lax``'s operations (float32 and uint32 arrays of one shape throughout): the same
    program as ``jax.numpy``'s, for some 100 operations that every step traces."""
    a, n, q = (jnp.asarray(x, jnp.float32) for x in (a, n, q))
    # The neighbours two ulps either way, as the next representations: for a normal q (what
    # is kept below) the floats ``nextafter`` steps to, on either side of a binade's edge,
    # in a handful of integer operations where ``nextafter`` takes some twenty (compile time).
    bits = lax.bitcast_convert_type(q, jnp.uint32)
    zero, one, two = (_full(q, k, jnp.uint32) for k in (0, 1, 2))
    near = [lax.add(bits, one), lax.add(bits, two), lax.sub(bits, one), lax.sub(bits, two)]
    others = [lax.bitcast_convert_type(b, jnp.float32) for b in near]
    # The smallest remainder; of two equal ones (the quotient lies half way), the even one.
    # The nearest of the five is one float, or two adjacent ones (one of them even): the
    # order they are tried in does not change which is kept.
    best, best_err = q, lax.abs(_remainder(a, q, n))
    for c, c_bits in zip(others, near, strict=True):
        err = lax.abs(_remainder(a, c, n))
        even = lax.eq(lax.bitwise_and(c_bits, one), zero)
        better = lax.bitwise_or(lax.lt(err, best_err), lax.bitwise_and(lax.eq(err, best_err), even))
        best, best_err = lax.select(better, c, best), lax.select(better, err, best_err)
    # Near zero the neighbours are subnormal, which XLA:CPU flushes to zero: keep q there
    # (0 itself is exact; a rate below 2**-100 is never read for its last bit).
    tiny = lax.lt(lax.abs(q), _full(q, TINY, jnp.float32))
    return lax.select(tiny, q, best)


def divide_by_count(a: jax.Array, n: jax.Array, q: jax.Array | None = None) -> jax.Array:
    """``a / n`` rounded once to float32, for a finite float32 ``a`` and an integer count
    ``1 <= n <= MAX_COUNT`` (float32 or int), the same bits on every backend (for quotients
    of magnitude at least ``TINY``; 0 is exact).

    ``q``: the backend's quotient, where the caller computed it (``a / n``, or a selection
    of such quotients with ``a`` and ``n`` selected alike: one correction for several
    divisions, whose result is each one's corrected quotient, elementwise)."""
    a = jnp.asarray(a, jnp.float32)
    n = jnp.asarray(n).astype(jnp.float32)
    q = a / n if q is None else jnp.asarray(q, jnp.float32)
    skew = _SKEW.value
    if skew:
        # From the rounded quotient, so the hook's skew is the whole error on every backend
        # (on a GPU it would otherwise add to the division's own, past what is corrected).
        q = _moved(correct_quotient(a, n, q), skew)
    return correct_quotient(a, n, q)


_SIGNIFICAND_BITS = 24  # float32's, the leading one included


@jax.jit  # one program when called outside a step (metrics, read eagerly), not ~100 ops
def ratio_of_counts(a: jax.Array, n: jax.Array) -> jax.Array:
    """``float32(a) / float32(n)`` rounded once (IEEE: to nearest, ties to even), for integer
    counts ``0 <= a <= n``, ``n >= 1`` (int32, any size), from integer operations alone: the
    same bits on every backend. Elementwise.

    Rule (uint32 throughout; ``A``, ``N``: the counts as float32 values, which are integers
    below ``2**31 + 1``)::

      s = clz(A) - clz(N); r = A << s; if r < N: r, s = 2 r, s + 1   # N <= r < 2 N
      bits = 1; r -= N                                  # the quotient's leading one: 2**-s
      repeat 24 times: r = 2 r; bit = r >= N; r -= bit * N; bits = 2 bits + bit
      m, round_bit = bits >> 1, bits & 1                # 24 significant bits and the next one
      m += round_bit and (r != 0 or m odd)              # to nearest, ties to even
      quotient = m * 2**-(s + 23)                       # exact: m <= 2**24

    ``r < N <= 2**31`` keeps ``2 r`` within uint32. ``A == 0`` gives 0; ``a > n`` (never in a
    state the library wrote) is divided by the backend.
    """
    f32, u32 = jnp.float32, jnp.uint32
    a_f = jnp.asarray(a).astype(f32)
    n_f = jnp.maximum(jnp.asarray(n).astype(f32), f32(1.0))
    big_a, big_n = a_f.astype(u32), n_f.astype(u32)
    safe_a = jnp.maximum(jnp.minimum(big_a, big_n), u32(1))  # 1 <= A <= N for the division
    s = (jax.lax.clz(safe_a) - jax.lax.clz(big_n)).astype(u32)
    r = jnp.left_shift(safe_a, s)
    low = r < big_n
    r = where(low, jnp.left_shift(r, u32(1)), r)
    s = where(low, s + u32(1), s)
    r = r - big_n
    bits = jnp.ones_like(r)
    for _ in range(_SIGNIFICAND_BITS):
        r = jnp.left_shift(r, u32(1))
        bit = r >= big_n
        r = where(bit, r - big_n, r)
        bits = jnp.left_shift(bits, u32(1)) | bit.astype(u32)
    m, round_bit = jnp.right_shift(bits, u32(1)), (bits & u32(1)) == 1
    up = round_bit & ((r != 0) | ((m & u32(1)) == 1))
    m = m + up.astype(u32)
    # 2**-(s + 23) for s <= 32: a normal float32, built from its exponent bits.
    scale = jax.lax.bitcast_convert_type((u32(127 - 23) - s) << u32(23), f32)
    exact = m.astype(f32) * scale
    return where(big_a == 0, f32(0.0), where(big_a <= big_n, exact, a_f / n_f))
