"""The overflow check with the gradient range in the same reduction (a prototype).

``check_and_amax(grads)`` returns what ``lsj.check_overflow`` returns plus ``amax``, the
largest |g| over every floating leaf (float32; overflowing values count as they are, a nan
may show as nan), from the same grouped variadic reductions: one kernel per group of same-shape
leaves, each leaf read once. The check's predicates are the library's own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lossscale_jax import numerics
from lossscale_jax.engine import _check


def _or_max(a, b):
    n = len(a) // 2
    flags = tuple(jnp.logical_or(x, y) for x, y in zip(a[:n], b[:n], strict=True))
    maxes = tuple(jnp.maximum(x, y) for x, y in zip(a[n:], b[n:], strict=True))
    return flags + maxes


def _magnitude(g):
    # float32: XLA:CPU reduces float32 faster than float16. A nan may reach the maximum
    # (the policy counts a maximum that is not finite as no measurement).
    return jnp.abs(g.astype(jnp.float32))


def check_and_amax(grads, mode="ieee", compute_dtype=jnp.float16):
    mode = numerics.validate_overflow_mode(mode)
    threshold = _check.threshold(compute_dtype)
    leaves = [jnp.asarray(g) for g in jax.tree_util.tree_leaves(grads) if _check.is_float(g)]
    groups: dict = {}
    for i, g in enumerate(leaves):
        groups.setdefault(tuple(g.shape), []).append(i)
    false = jnp.zeros([], jnp.bool_)
    flags, maxes = [], []
    for shape, members in groups.items():
        dims = tuple(range(len(shape)))
        # Two outputs per leaf: half as many leaves per kernel (XLA:CPU slows past ~16).
        for start in range(0, len(members), _check.GROUP // 2):
            chunk = members[start : start + _check.GROUP // 2]
            tests = tuple(
                jnp.logical_or(*_check.predicates(leaves[i], mode, threshold)) for i in chunk
            )
            mags = tuple(_magnitude(leaves[i]) for i in chunk)
            zero = jnp.zeros([], jnp.float32)
            out = lax.reduce(
                tests + mags, (false,) * len(chunk) + (zero,) * len(chunk), _or_max, dims
            )
            flags += out[: len(chunk)]
            maxes += [m.astype(jnp.float32) for m in out[len(chunk) :]]
    if not leaves:
        return false, jnp.zeros([], jnp.float32)
    return jnp.any(jnp.stack(flags)), jnp.max(jnp.stack(maxes))
