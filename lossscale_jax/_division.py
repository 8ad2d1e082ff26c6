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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MAX_COUNT = 2**12 - 1
"""The largest divisor :func:`divide_by_count` rounds exactly."""

TINY = 2.0**-100
"""Quotients smaller in magnitude are returned as the backend computed them."""

_HIGH_BITS = np.uint32(0xFFFFF000)  # sign, exponent and the top 12 of 24 significant bits


def _remainder(a: jax.Array, q: jax.Array, n: jax.Array) -> jax.Array:
    """``a - q * n``, exactly (see the module's docstring)."""
    hi = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(q, jnp.uint32) & _HIGH_BITS, jnp.float32
    )
    lo = q - hi
    return (a - hi * n) - lo * n


def correct_quotient(a: jax.Array, n: jax.Array, q: jax.Array) -> jax.Array:
    """The float32 nearest ``a / n`` (ties to even), given ``q`` within two ulps of it."""
    up = jnp.float32(np.inf)
    down = jnp.float32(-np.inf)
    q_up = jnp.nextafter(q, up)
    q_down = jnp.nextafter(q, down)
    others = [jnp.nextafter(q_down, down), q_down, q_up, jnp.nextafter(q_up, up)]
    # The smallest remainder; of two equal ones (the quotient lies half way), the even one.
    best, best_err = q, jnp.abs(_remainder(a, q, n))
    for c in others:
        err = jnp.abs(_remainder(a, c, n))
        even = (jax.lax.bitcast_convert_type(c, jnp.uint32) & 1) == 0
        better = (err < best_err) | ((err == best_err) & even)
        best, best_err = jnp.where(better, c, best), jnp.where(better, err, best_err)
    corrected = best
    # Near zero the neighbours are subnormal, which XLA:CPU flushes to zero: keep q there
    # (0 itself is exact; a rate below 2**-100 is never read for its last bit).
    return jnp.where(jnp.abs(q) < TINY, q, corrected)


def divide_by_count(a: jax.Array, n: jax.Array) -> jax.Array:
    """``a / n`` rounded once to float32, for a finite float32 ``a`` and an integer count
    ``1 <= n <= MAX_COUNT`` (float32 or int), the same bits on every backend (for quotients
    of magnitude at least ``TINY``; 0 is exact)."""
    a = jnp.asarray(a, jnp.float32)
    n = jnp.asarray(n).astype(jnp.float32)
    return correct_quotient(a, n, a / n)
