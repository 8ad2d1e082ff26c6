"""A trainer's loss wrapped in ``lsj.value_and_grad``, and its gradients unscaled.

A host's step takes ``jax.value_and_grad(loss_fn)`` of its own loss; :func:`scaled` is the
same call for the scaled loss (the loss returned as ``loss_fn`` gives it, the gradients
scaled, ready for the loss-scaled optimizer's update, which unscales, checks and skips).
:func:`unscaled` is what the host logs its gradient norms from: the gradients divided by the
scale they were taken with, in float32 (inf or nan on a step that overflowed, as they are).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from lossscale_jax.access._access import get_loss_scale_state
from lossscale_jax.engine._unscale import inverse
from lossscale_jax.gradients import value_and_grad


def scaled(
    loss_fn: Callable[..., Any], opt_state: Any, *, has_aux: bool = False, argnums: Any = 0
) -> Callable[..., tuple[Any, Any]]:
    """``jax.value_and_grad(loss_fn, argnums, has_aux)`` of the loss scaled by the scale in
    ``opt_state`` (the state the step's optimizer update is given)."""
    return value_and_grad(loss_fn, opt_state, argnums=argnums, has_aux=has_aux)


def unscaled(grads: Any, opt_state: Any) -> Any:
    """``grads / scale`` in float32, leaf by leaf (non-floating leaves as they are)."""
    inv = inverse(jnp.asarray(get_loss_scale_state(opt_state).scale))

    def one(g: Any) -> Any:
        if not (hasattr(g, "dtype") and jnp.issubdtype(g.dtype, jnp.floating)):
            return g
        return g.astype(jnp.float32) * inv

    return jax.tree_util.tree_map(one, grads)
