"""The benchmark's one door to lossscale_jax's internals.

Everything else in the package uses public names only (``lsj.loss_scaling``,
``lsj.LossScalingState``, ``lsj.unscale``, ...). The prototypes need three things the library
does not publish (from its engine, ``lossscale_jax/engine/``), and they are all here, so that
when the library's private modules move this file changes and nothing else does:

- ``_check.leaf_flags`` (the per-leaf overflow check) and ``_check.GROUP`` (how many
  same-shape leaves one reduction checks), replaced while a step is traced
  (``traced_with_check``);
- the engine a ``loss_scaling`` update carries (``_engine.engine_of``: the inner
  transformation and the engine's check and decision), from which the Optax-path
  prototypes rebuild the step (``loss_scaling_parts``);
- ``numerics.overflow_flags``, the per-leaf record the compile-time skeleton checks with
  (``leaf_overflow_vector``);
- ``_skip.formulation``: the skip's formulation forced while a step is traced
  (``skip_formulation``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax

from lossscale_jax import numerics
from lossscale_jax.engine import _check, _engine, _skip

#: ``(leaves, mode, threshold) -> [one scalar bool per leaf]``: an overflow check that
#: measures no range.
LeafCheck = Callable[[list[jax.Array], str, float], list[jax.Array]]


def _flags_only(check: LeafCheck) -> Callable:
    """``check`` in ``_check.leaf_flags``'s signature; it measures no range, and reads the
    leaves themselves (the library's elementwise ``tests``, where given, are left unused)."""

    def leaf_flags(leaves, mode, threshold, with_max=False, tests=None):
        if with_max:
            raise NotImplementedError("the alternative checks measure no range (HeadroomScale)")
        return check(leaves, mode, threshold)

    return leaf_flags


@contextlib.contextmanager
def traced_with_check(check: LeafCheck | None = None, group: int | None = None) -> Iterator[None]:
    """Traces the library with ``check`` as its per-leaf overflow check, or ``group`` same-shape
    leaves per reduction (the library's own where None); both are restored on exit."""
    saved = (_check.leaf_flags, _check.GROUP)
    try:
        if group is not None:
            _check.GROUP = group
        if check is not None:
            _check.leaf_flags = _flags_only(check)
        yield
    finally:
        _check.leaf_flags, _check.GROUP = saved


def loss_scaling_parts(tx: optax.GradientTransformation) -> tuple[Any, Callable]:
    """``(inner, decide)`` of a ``loss_scaling`` transformation: the wrapped transformation and
    ``decide(scaled_grads, loss_scale, leaf_overflow) -> (loss_scale, apply, leaf_overflow)``."""
    built = _engine.engine_of(tx)
    if built is None:
        raise TypeError(f"tx must be built by lossscale_jax.loss_scaling, got {tx!r}.")
    engine = built.engine

    def decide(scaled_grads: Any, loss_scale: Any, leaf_overflow: Any) -> tuple[Any, Any, Any]:
        check = engine.check(scaled_grads, loss_scale.scale, leaf_overflow)
        new, apply = engine.decide(loss_scale, check)
        return new, apply, check.flags

    return built.inner, decide


def leaf_overflow_vector(grads: Any) -> jax.Array:
    """One ``bool`` per leaf of ``grads`` (``tree_leaves`` order): what ``loss_scaling`` checks
    and records as ``leaf_overflow``."""
    return jnp.stack(jax.tree_util.tree_leaves(numerics.overflow_flags(grads)))


def skip_formulation(name: str) -> contextlib.AbstractContextManager[None]:
    """Steps traced inside skip with ``name`` (``"cond"`` or ``"select"``) on every backend."""
    return _skip.formulation(name)
