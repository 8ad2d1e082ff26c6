"""Whether a ratio of two step counts reaches a threshold, decided exactly as Python decides it.

fairseq's scaler backs off when ``overflows / float(iterations) >= tolerance``: two integers
divided in float64 and compared with a float64 threshold. A float32 quotient gives another
answer near the threshold (``1 / 10 >= 0.1`` holds in float64 because the quotient rounds
to the threshold itself), and JAX computes in float32 unless float64 is switched on for the
whole process. :class:`RatioThreshold` gets Python's answer with integer arithmetic alone:

- On the host, once: the real numbers whose float64 rounding is ``>= t`` are those above
  the midpoint ``m`` between ``t`` and the float64 below it (``m`` itself if it rounds up,
  ties going to the even one). The counts are below ``2**31``, so ``num / den`` is a
  fraction with a denominator below ``2**31``, and ``num / den > m`` holds exactly when
  ``num / den >= f``, ``f`` the nearest such fraction above ``m`` (its Farey neighbour,
  found by the Stern-Brocot descent). Above 1 the same is done for ``den / num`` against
  ``1 / m``, so both fractions compared have terms below ``2**31``.
- In the step: ``num / den >= p / q`` is ``num * q >= p * den``, two products below
  ``2**62`` compared as pairs of uint32 words (each product from 16-bit halves).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

MAX_COUNT = 2**31 - 1
"""The largest numerator or denominator the comparison is exact for (the int32 counters')."""

_LOW16 = np.uint32(0xFFFF)


def _neighbours(x: Fraction, n: int) -> tuple[Fraction, Fraction]:
    """The fractions with denominators ``<= n`` nearest ``x`` below and above it.

    ``x`` must not itself have a denominator ``<= n``. Stern-Brocot descent: ``lo`` and
    ``hi`` stay adjacent (``hi.p * lo.q - lo.p * hi.q == 1``), so no fraction of a
    denominator below ``lo.q + hi.q`` lies between them; each pass moves one of them to the
    farthest mediant on its side of ``x`` that the bound allows.
    """
    a = math.floor(x)
    lp, lq, hp, hq = a, 1, a + 1, 1
    while True:
        moved = False
        # lo + k * hi stays below x while k < (x * lq - lp) / (hp - x * hq).
        k = min(math.ceil((x * lq - lp) / (hp - x * hq)) - 1, (n - lq) // hq)
        if k >= 1:
            lp, lq, moved = lp + k * hp, lq + k * hq, True
        # hi + k * lo stays above x while k < (hp - x * hq) / (x * lq - lp).
        k = min(math.ceil((hp - x * hq) / (x * lq - lp)) - 1, (n - hq) // lq)
        if k >= 1:
            hp, hq, moved = hp + k * lp, hq + k * lq, True
        if not moved:
            return Fraction(lp, lq), Fraction(hp, hq)


def _product(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a * b`` for uint32 ``a, b < 2**31``, exactly, as its (high, low) uint32 words."""
    a1, a0 = a >> 16, a & _LOW16
    b1, b0 = b >> 16, b & _LOW16
    low = a0 * b0
    mid = a0 * b1 + a1 * b0  # each term < 2**31, so the sum fits
    lo = low + (mid << 16)  # modulo 2**32
    carry = (lo < low).astype(jnp.uint32)
    return a1 * b1 + (mid >> 16) + carry, lo


def _at_least(a: jax.Array, b: jax.Array, c: jax.Array, d: jax.Array, inclusive: bool) -> jax.Array:
    """``a * b >= c * d`` (``>`` unless ``inclusive``) for uint32 terms below ``2**31``."""
    (h1, l1), (h2, l2) = _product(a, b), _product(c, d)
    above = (h1 > h2) | ((h1 == h2) & (l1 > l2))
    if inclusive:
        return above | ((h1 == h2) & (l1 == l2))
    return above


@dataclasses.dataclass(frozen=True)
class RatioThreshold:
    """``num / float(den) >= threshold`` in Python (float64), for int32 counts, under jit.

    Rule::

      at_least(num, den) == (int(num) / float(int(den)) >= threshold)
      for 0 <= num <= 2**31 - 1 and 1 <= den <= 2**31 - 1

    Built once on the host from ``threshold`` (a finite Python float); the comparison in the
    step is integer arithmetic only, so it is the same on every backend.
    """

    threshold: float
    # num / den >= p / q (num * q >= p * den), or, when ``flipped``, den / num <= p / q
    # (p * num >= den * q); ``inclusive``: whether equality counts.
    p: int = dataclasses.field(init=False)
    q: int = dataclasses.field(init=False)
    flipped: bool = dataclasses.field(init=False)
    inclusive: bool = dataclasses.field(init=False)
    always: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        t = float(self.threshold)
        if not math.isfinite(t):
            raise ValueError(f"threshold must be a finite number, got {self.threshold!r}.")
        values: dict[str, object] = {
            "always": t <= 0.0,
            "p": 0,
            "q": 1,
            "flipped": False,
            "inclusive": True,
        }
        if t > 0.0:
            below = math.nextafter(t, 0.0)
            m = (Fraction(below) + Fraction(t)) / 2  # the reals rounding to >= t start here
            inclusive = float(m) >= t  # m itself rounds to t (ties to even)
            flipped = m > 1
            x = 1 / m if flipped else m
            # num/den > m  <=>  den/num < 1/m: the inclusion of the midpoint carries over.
            if x.denominator <= MAX_COUNT:
                p, q = x.numerator, x.denominator
            else:
                lo, hi = _neighbours(x, MAX_COUNT)
                p, q = (lo.numerator, lo.denominator) if flipped else (hi.numerator, hi.denominator)
                inclusive = True  # x is no count ratio: the nearest one on the right side is
            values.update(p=p, q=q, flipped=flipped, inclusive=inclusive)
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def at_least(self, num: jax.Array, den: jax.Array) -> jax.Array:
        """Whether ``num / float(den) >= threshold``, as Python computes it (bool array)."""
        if self.always:
            return jnp.ones(jnp.shape(num), jnp.bool_)
        u32 = jnp.uint32
        num_u = jnp.clip(num, 0, MAX_COUNT).astype(u32)
        den_u = jnp.clip(den, 1, MAX_COUNT).astype(u32)
        p, q = jnp.asarray(self.p, u32), jnp.asarray(self.q, u32)
        if self.flipped:
            return _at_least(p, num_u, den_u, q, self.inclusive)
        return _at_least(num_u, q, p, den_u, self.inclusive)
