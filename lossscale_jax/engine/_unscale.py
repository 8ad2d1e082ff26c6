"""Unscaling: the division by the loss scale, in float32 at least, into the parameter's dtype.

A bad scale in the state (0, negative, inf, nan) is never read back to the host: its
inverse is nan, so every unscaled gradient is nan and every check downstream sees it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from lossscale_jax.engine._check import at_least_float32, is_float
from lossscale_jax.engine._ops import where
from lossscale_jax.engine._wiring import refuse_non_float


def unscaled_dtype(g: jax.Array, p: Any) -> Any:
    if p is not None and is_float(p):
        return p.dtype
    if g.dtype == jnp.float16:
        # Dividing in float16 would underflow again: the very loss the scale
        # was there to prevent.
        return jnp.float32
    return g.dtype


def unscale_leaf(g: Any, inv_scale: jax.Array, p: Any = None) -> Any:
    if not is_float(g):
        return g
    dtype = unscaled_dtype(g, p)
    # Multiply in float32 at least, then cast to the target dtype (in lax's operations, the
    # program jax.numpy's would give: once per gradient, in every step's trace).
    work = at_least_float32(dtype)
    g = lax.convert_element_type(jnp.asarray(g), work)
    factor = lax.broadcast(lax.convert_element_type(inv_scale, work), g.shape)
    return lax.convert_element_type(lax.mul(g, factor), dtype)


def valid_scale(scale: ArrayLike) -> jax.Array:
    """``scale`` as a float32 scalar; a host value that is not finite and > 0 raises.

    A Python or NumPy value is checked here (``ValueError``). A JAX array is
    not read back to the host (that would be a host sync): its validity is
    computed on the device, see ``inverse`` and ``scale_is_bad``.
    """
    if not isinstance(scale, jax.Array):
        host = np.asarray(scale)
        if host.dtype == np.bool_ or not (
            np.issubdtype(host.dtype, np.floating) or np.issubdtype(host.dtype, np.integer)
        ):
            raise TypeError(f"scale must be a real number, got {scale!r}.")
        if host.shape != ():
            raise ValueError(f"scale must be a scalar, got shape {host.shape}.")
        value = float(host)
        if not (np.isfinite(value) and value > 0.0 and np.float32(value) > 0.0):
            raise ValueError(
                f"scale must be a finite number > 0, got {scale!r}: unscaling by it would "
                "return inf, nan or sign-flipped gradients."
            )
    arr = jnp.asarray(scale, jnp.float32)
    if arr.shape != ():
        raise ValueError(f"scale must be a scalar, got shape {arr.shape}.")
    return arr


def scale_is_bad(scale: jax.Array) -> jax.Array:
    """A scalar bool: ``scale`` (float32) is not a finite number > 0."""
    return jnp.logical_not(jnp.logical_and(scale > 0.0, jnp.isfinite(scale)))


def inverse(scale: ArrayLike) -> jax.Array:
    """``1 / scale`` in float32, or nan when ``scale`` is not finite and > 0.

    nan makes every unscaled gradient nan, which every check sees, instead of
    inf (scale 0), zeros (scale inf) or sign-flipped gradients (scale < 0).
    For a valid scale the value is exactly ``1 / scale``.
    """
    scale = valid_scale(scale)
    return where(scale_is_bad(scale), jnp.float32(jnp.nan), 1.0 / scale)


def unscale_tree(grads: Any, scale: ArrayLike, params: Any = None) -> Any:
    """Every floating leaf of ``grads`` divided by ``scale`` (see ``numerics.unscale``); an
    integer or bool leaf is refused (``_wiring.refuse_non_float``)."""
    refuse_non_float(grads, "unscale")
    inv = inverse(scale)
    if params is None:
        return jax.tree_util.tree_map(lambda g: unscale_leaf(g, inv), grads)
    return jax.tree_util.tree_map(lambda g, p: unscale_leaf(g, inv, p), grads, params)
