"""A window of micro-batches: the float32 sum of the good ones, and its mean.

Shared by ``loss_scaling_multi_steps`` and per-layer scaling with ``every_k > 1``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale_jax.engine._check import at_least_float32, is_float
from lossscale_jax.engine._ops import where


def acc_zeros(p: Any) -> jax.Array:
    """The accumulator of one parameter leaf: zeros in float32 at least."""
    if is_float(p):
        return jnp.zeros(jnp.shape(p), at_least_float32(p.dtype))
    # Non-floating parameters have no gradient to accumulate; keep a placeholder.
    return jnp.zeros([], jnp.int32)


def cleared(record: jax.Array | None) -> jax.Array | None:
    return None if record is None else jnp.zeros_like(record)


def add_good(acc: Any, grads: Any, overflow: jax.Array) -> Any:
    """``acc + grads`` leaf by leaf, unless this micro-batch overflowed (on any device):
    the sum stays finite, and a policy that does not skip applies the good ones."""

    def add(a: jax.Array, g: Any) -> jax.Array:
        if not is_float(g):
            return a
        return where(overflow, a, a + g.astype(a.dtype))

    return jax.tree_util.tree_map(add, acc, grads)


def mean_of(acc: Any, like: Any, every_k: int) -> Any:
    """The window's mean in the dtypes of ``like``: the sum times the reciprocal of
    ``every_k`` rounded to the accumulator's dtype (what XLA makes of a division by a
    constant anyway, written out so the step gives the same bits inside and outside
    ``jax.jit``)."""

    def leaf(a: jax.Array, g: Any) -> Any:
        if not is_float(g):
            return g
        inverse = np.asarray(1.0 / every_k, np.float64).astype(a.dtype)
        return (a * jnp.asarray(inverse, a.dtype)).astype(g.dtype)

    return jax.tree_util.tree_map(leaf, acc, like)
