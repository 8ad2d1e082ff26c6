"""``jnp.where`` and ``jnp.isinf`` as the step calls them, without the jit each wraps itself in.

``jax.numpy`` defines both under ``jax.jit``: each call traced inside a step is a nested jit
(its own trace, looked up in a cache by the operands' types, a ``jit`` equation in the jaxpr,
and a function of its own in the lowered module, which XLA inlines again). A step calls
them some hundred times (a select per optimizer leaf, the overflow test per gradient, every
counter and scale of the state): measured on JAX 0.12, 50 ``jnp.where`` on arrays of distinct
shapes traced in 62-85 ms and lowered in 35 ms, their ``lax.select_n`` in 10-12 ms and 15-22 ms.

Each function here binds the primitive JAX's own binds (a ``select_n``; an ``abs`` and an
``eq`` against infinity) where nothing else is needed: the same values, the same program once
XLA has inlined JAX's, and no jit. Any other case (operands to promote or broadcast, a Python
number, types that differ in weakness, sharding or varying axes) is ``jax.numpy``'s own call.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lossscale_jax.engine._devices import varying_axes


def _array_type(x: Any) -> Any:
    return jax.typeof(x) if isinstance(x, jax.Array) else None


def where(condition: Any, x: Any, y: Any) -> jax.Array:
    """``jnp.where(condition, x, y)``: one ``lax.select_n`` where ``x`` and ``y`` are arrays
    of one type (shape, dtype, weakness, sharding, varying axes) and ``condition`` a boolean
    array of no dimensions or of their shape, with their varying axes; else ``jnp.where``."""
    tx, ty, tc = _array_type(x), _array_type(y), _array_type(condition)
    if (
        tx is not None
        and tc is not None
        and tx == ty
        and tc.dtype == np.bool_
        and varying_axes(tc) == varying_axes(tx)
        and (tc.shape == () or tc == tx.update(dtype=tc.dtype, weak_type=tc.weak_type))
    ):
        return lax.select_n(condition, y, x)
    return jnp.where(condition, x, y)


def isinf(x: Any) -> jax.Array:
    """``jnp.isinf(x)``: ``|x| == inf`` for a floating array, as JAX computes it; else
    ``jnp.isinf``."""
    tx = _array_type(x)
    if tx is not None and jnp.issubdtype(tx.dtype, jnp.floating):
        return lax.eq(lax.abs(x), np.asarray(np.inf, tx.dtype))
    return jnp.isinf(x)
