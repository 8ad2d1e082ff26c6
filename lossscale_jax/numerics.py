"""Pure functions on gradient pytrees: overflow detection and unscaling.

Nothing here holds state. Every function is jit-able and makes no Python
decision on array values.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from lossscale_jax.engine._check import (
    COMPUTE_DTYPES,
    OVERFLOW_MODES,
    OverflowMode,
    at_least_float32,
    every_leaf_flags,
    is_float,
    max_of,
    reduce_any,
    validate_compute_dtype,
    validate_overflow_mode,
)
from lossscale_jax.engine._unscale import scale_is_bad, unscale_tree, valid_scale

__all__ = [
    "COMPUTE_DTYPES",
    "OVERFLOW_MODES",
    "OverflowMode",
    "at_least_float32",
    "check_overflow",
    "check_overflow_and_range",
    "overflow_flags",
    "unscale",
    "unscale_and_check",
    "validate_compute_dtype",
    "validate_overflow_mode",
]


def overflow_flags(
    grads: Any,
    mode: OverflowMode = "ieee",
    compute_dtype: Any = jnp.float16,
) -> Any:
    """One overflow flag per leaf of ``grads``, from the pass ``check_overflow`` makes.

    Rule::

      flags[leaf] = overflow(leaf)     # the rule of check_overflow, leaf by leaf
      check_overflow(grads) == any(flags)

    Non-floating leaves (integer, bool, ``float0``) get ``False``; ``None``
    leaves are empty subtrees and stay ``None``.

    Args:
      grads: a pytree of (scaled) gradients.
      mode: ``"ieee"``, ``"saturating"`` or ``"both"``.
      compute_dtype: the dtype whose ``finfo.max`` is the saturating threshold.

    Returns:
      A pytree with the structure of ``grads`` and a scalar ``bool`` array
      at every leaf.

    Examples:
      >>> import jax.numpy as jnp
      >>> from lossscale_jax import numerics
      >>> g = {"w": jnp.array([1.0, jnp.inf], jnp.float16), "b": jnp.ones(2, jnp.float16)}
      >>> {k: bool(v) for k, v in numerics.overflow_flags(g).items()}
      {'b': False, 'w': True}
    """
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    flags, _ = every_leaf_flags(leaves, mode, compute_dtype)
    return jax.tree_util.tree_unflatten(treedef, flags)


def check_overflow_and_range(
    grads: Any,
    mode: OverflowMode = "ieee",
    compute_dtype: Any = jnp.float16,
) -> tuple[jax.Array, jax.Array]:
    """``check_overflow(grads)`` and the gradients' range, from the same pass.

    Rule::

      overflow = check_overflow(grads, mode, compute_dtype)
      amax = max(|g| over every floating leaf)          # float32; a nan may show as nan

    The magnitude is taken in the same grouped reductions as the check (one
    kernel per group of same-shape leaves, one read of each gradient, no
    leaf-sized temporary). ``HeadroomScale`` reads it as a fraction of the
    range at scale 1: ``amax / (scale * finfo(compute_dtype).max)``. When
    ``overflow`` is set, ``amax`` says nothing (an inf, or a saturated 65504).

    Args:
      grads: a pytree of (scaled) gradients.
      mode: ``"ieee"``, ``"saturating"`` or ``"both"``.
      compute_dtype: the dtype whose ``finfo.max`` is the saturating threshold.

    Returns:
      ``(overflow, amax)``: a scalar bool and a scalar float32 (0 without
      floating leaves).

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale_jax as lsj
      >>> g = {"w": jnp.array([1.0, -300.0], jnp.float16), "b": jnp.array([2.0], jnp.float16)}
      >>> overflow, amax = lsj.check_overflow_and_range(g)
      >>> bool(overflow), float(amax)
      (False, 300.0)
    """
    leaves = [g for g in jax.tree_util.tree_leaves(grads) if is_float(g)]
    flags, maxes = every_leaf_flags(leaves, mode, compute_dtype, with_max=True)
    return reduce_any(flags), max_of(maxes)


def check_overflow(
    grads: Any,
    mode: OverflowMode = "ieee",
    compute_dtype: Any = jnp.float16,
) -> jax.Array:
    """Whether any floating leaf of ``grads`` overflowed.

    Rule::

      ieee:        any(not isfinite(g))                 # inf, -inf, nan
      saturating:  any(|g| >= finfo(compute_dtype).max)  # what a saturating device writes
      both:        ieee or saturating

    Non-floating leaves (integer, bool, ``float0``) carry no gradient and are
    not checked; ``None`` leaves are empty subtrees. Under ``jit`` the check is
    one read of each leaf and writes nothing of a leaf's size: the per-leaf
    flags (``overflow_flags``) come from variadic reductions, one per group of
    same-shape leaves, and this is their ``any``.

    Args:
      grads: a pytree of (scaled) gradients.
      mode: ``"ieee"``, ``"saturating"`` or ``"both"``.
      compute_dtype: the dtype the backward pass computed in; the saturating
        threshold is ``finfo(compute_dtype).max`` (65504 for float16), also
        when the gradients arrive in float32.

    Returns:
      A scalar ``bool`` array.

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale_jax as lsj
      >>> g = {"w": jnp.array([1.0, 65504.0], jnp.float16)}
      >>> bool(lsj.check_overflow(g, "ieee")), bool(lsj.check_overflow(g, "saturating"))
      (False, True)
    """
    leaves = [g for g in jax.tree_util.tree_leaves(grads) if is_float(g)]
    return reduce_any(every_leaf_flags(leaves, mode, compute_dtype)[0])


def unscale(grads: Any, scale: ArrayLike, params: Any = None) -> Any:
    """Divides every floating leaf of ``grads`` by ``scale``.

    Each unscaled leaf takes the dtype of its parameter when ``params`` is
    given (fp32 master weights get float32 gradients even when the gradients
    were taken in float16); without ``params``, float16 leaves come out in
    float32 and other leaves keep their dtype. The division is done in at
    least float32. An integer or bool leaf is refused (it cannot be divided back
    into a gradient); a ``float0`` leaf (``jax.grad(..., allow_int=True)``'s, no
    value) passes.

    The scale must be finite and > 0. A Python or NumPy scale that is not
    raises ``ValueError``; a JAX array is not read back to the host, and a bad
    one (0, negative, inf, nan) makes every unscaled gradient nan, so that any
    overflow check downstream sees it.

    Args:
      grads: a pytree of scaled gradients.
      scale: the loss scale (a scalar).
      params: optional pytree with the structure of ``grads``.

    Returns:
      The unscaled gradients.

    Raises:
      ValueError: if ``scale`` is a host number that is not finite and > 0, or
        not a scalar.
      errors.GradientDtypeError: (a ``TypeError``) for an integer or bool leaf,
        naming it.

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale_jax as lsj
      >>> g = {"w": jnp.array([3.0], jnp.float16)}
      >>> lsj.unscale(g, 2.0**20)["w"].dtype
      dtype('float32')
    """
    return unscale_tree(grads, scale, params)


def unscale_and_check(
    grads: Any,
    scale: ArrayLike,
    *,
    params: Any = None,
    mode: OverflowMode = "ieee",
    compute_dtype: Any = jnp.float16,
) -> tuple[Any, jax.Array]:
    """Unscales ``grads`` and checks them for overflow in one pass per leaf.

    Equivalent to ``(unscale(grads, scale, params), check_overflow(grads, mode,
    compute_dtype))``: the check reads the scaled gradient, so a saturated
    65504 is caught before the division hides it. Both are elementwise on
    the same leaf, so under ``jit`` XLA is free to fuse them with the
    gradient's producer or consumer.

    A scale that is not finite and > 0 raises ``ValueError`` when it is a
    Python or NumPy number; a JAX array one counts as an overflow (the step is
    skipped in every mode) and its unscaled gradients are nan.

    Args:
      grads: a pytree of scaled gradients.
      scale: the loss scale.
      params: optional pytree of parameters (dtype targets, see ``unscale``).
      mode: ``"ieee"``, ``"saturating"`` or ``"both"``.
      compute_dtype: dtype whose ``finfo.max`` is the saturating threshold.

    Returns:
      ``(unscaled_grads, overflow)`` with ``overflow`` a scalar bool array.

    Raises:
      ValueError: if ``scale`` is a host number that is not finite and > 0.

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale_jax as lsj
      >>> g = {"w": jnp.array([2.0, 4.0], jnp.float16)}
      >>> grads, overflow = lsj.unscale_and_check(g, 4.0)
      >>> grads["w"], bool(overflow)
      (Array([0.5, 1. ], dtype=float32), False)
      >>> bool(lsj.unscale_and_check(g, jnp.float32(0.0))[1])   # a bad device scale
      True
    """
    scale = valid_scale(scale)
    # The check's grouped reductions (one kernel per group of same-shape leaves);
    # the unscale is elementwise, so XLA fuses it with the gradient's consumer.
    found = check_overflow(grads, mode, compute_dtype)
    return unscale(grads, scale, params), jnp.logical_or(found, scale_is_bad(scale))
