"""The wiring check's analysis, rule by rule: the power of a scale ``S`` that a traced value
carries, against what algebra says by hand.

Each case traces ``f(S, x)`` under ``jax.jit`` and asks the analysis (``engine/_interpret``)
what ``f``'s result carries: a set of forms (a select or a branch picks one), each a sum of
terms ``(power, mark)`` with mark 1 where ``S`` reached the term outside a backward pass, 2
through one, and 3 for an input of the step (``x``) moved or summed, whose power the check
does not know. ``{}`` (an empty sum) is zero; ``None``, unknown.
"""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp
import pytest

from lossscale_jax.engine import _interpret

X = jnp.linspace(0.5, 1.5, 3)


def _carried(f):
    seen = {}

    def traced(s, x):
        y = f(s, x)
        seen["value"] = _interpret.Powers(s).value(y)
        return y

    jax.jit(traced).trace(jnp.float32(8.0), X)
    value = seen["value"]
    if value is None:
        return None
    return {frozenset((float(k), m) for k, m in alt) for alt in value}


def _one(*terms):
    return {frozenset(terms)}


CASES = {
    # S * x: the power 1, outside any backward pass
    "product": (lambda s, x: s * x, _one((1.0, 1))),
    # x / S: the power -1
    "quotient": (lambda s, x: x / s, _one((-1.0, 1))),
    # sqrt(sum((S x)^2)): 2 under a square root, 1
    "norm": (lambda s, x: jnp.sqrt(jnp.sum((s * x) ** 2)), _one((1.0, 1))),
    # rsqrt(S^2 x): -1
    "rsqrt": (lambda s, x: jax.lax.rsqrt(s * s * x), _one((-1.0, 1))),
    # S x + 2 x: a sum of the powers 1 and 0
    "mixed": (lambda s, x: s * x + 2 * x, _one((1.0, 1), (0.0, 0))),
    # S x + x: x is an input of the step, added as it came: its power is not known
    "input": (lambda s, x: s * x + x, _one((1.0, 1), (0.0, 3))),
    # S x - S x / 2 * 2: one power, the terms merge
    "same power": (lambda s, x: s * x - s * x / 2 * 2, _one((1.0, 1))),
    # where(x > 0, S x, 0): S x or zero
    "where": (lambda s, x: jnp.where(x > 1, s * x, 0.0), {frozenset({(1.0, 1)}), frozenset()}),
    # max(S x, x): one or the other
    "max": (
        lambda s, x: jnp.maximum(s * x, 2 * x),
        {frozenset({(1.0, 1)}), frozenset({(0.0, 0)})},
    ),
    # exp(S): no power of S
    "exp": (lambda s, x: jnp.exp(s) * x, None),
    # exp(S / S * x): S cancelled first, so exp sees no scale (the mark stays)
    "cancelled": (lambda s, x: jnp.exp(s * x / s), _one((0.0, 1))),
    # a comparison holds no magnitude: sum(x * (S > 1)) is free of S
    "comparison": (lambda s, x: x * (s > 1.0), _one((0.0, 0))),
    # the gradient of S * sum(w x) in w: S x, S reaching it through the backward pass
    "backward": (lambda s, x: jax.grad(lambda w: s * jnp.sum(w * x))(x), _one((1.0, 2))),
    # the same with S applied after the backward pass
    "after": (lambda s, x: jax.grad(lambda w: jnp.sum(w * x))(x) * s, _one((1.0, 1))),
    # a scan that adds S x each turn to a zero carry: zero (no turn) or S x
    "scan": (
        lambda s, x: jax.lax.scan(lambda c, _: (c + s * x, None), jnp.zeros(3), None, 4)[0],
        {frozenset(), frozenset({(1.0, 1)})},
    ),
    # a loop that multiplies by S each turn reaches no fixed point: unknown
    "growing": (lambda s, x: jax.lax.fori_loop(0, 3, lambda i, c: c * s, x), None),
    # a cond: one branch's power or the other's
    "cond": (
        lambda s, x: jax.lax.cond(x[0] > 0, lambda: s * x, lambda: s * s * x),
        {frozenset({(1.0, 1)}), frozenset({(2.0, 1)})},
    ),
    # a nested jit and a checkpoint are read through
    "jit and remat": (lambda s, x: jax.checkpoint(jax.jit(lambda a: a * a))(s) * x, _one((2.0, 1))),
    # bfloat16 is floating: it carries the scale as float32 does
    "bfloat16": (lambda s, x: (s * x).astype(jnp.bfloat16).astype(jnp.float32), _one((1.0, 1))),
    # an integer computed from S is taken as free of it (a documented blind spot)
    "integer": (lambda s, x: x * (s.astype(jnp.int32) + 1), _one((0.0, 0))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_power_a_value_carries(name):
    f, want = CASES[name]
    assert _carried(f) == want


def test_nan_and_zero_constants_are_every_power():
    # what an unscaling by a bad scale gives: where(bad, nan, 1 / S) times S x is S x**0 or nan
    got = _carried(lambda s, x: jnp.where(s > 0, 1.0 / s, jnp.nan) * (s * x))
    assert got == {frozenset({(0.0, 1)}), frozenset()}


def test_a_square_root_halves_the_power_exactly():
    seen = {}

    def traced(s, x):
        y = jnp.sqrt(s) * jnp.sqrt(jnp.sqrt(s)) * x
        seen["value"] = _interpret.Powers(s).value(y)
        return y

    jax.jit(traced).trace(jnp.float32(8.0), X)
    assert seen["value"] == frozenset({frozenset({(Fraction(3, 4), 1)})})
