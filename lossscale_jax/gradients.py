"""The scaled gradients of a loss, for loops that own their step: ``value_and_grad`` and the
unscaled global norm they log.

``value_and_grad(loss_fn, opt_state)`` is the right wiring written once: the gradients of
``scale_loss(loss_fn(...), opt_state)``, the loss as ``loss_fn`` returned it. Given a Flax
NNX optimizer instead of a state, it differentiates with ``nnx.value_and_grad`` and reads the
optimizer's state when called, so that inside the step it reads the step's own optimizer.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from lossscale_jax.access._access import get_loss_scale_state, scale_loss
from lossscale_jax.engine._check import is_float
from lossscale_jax.engine._hyper import check_argnums
from lossscale_jax.engine._unscale import inverse
from lossscale_jax.engine._wiring import refuse_scaled_twice

__all__ = ["unscaled_global_norm", "value_and_grad"]


def _nnx_optimizer(x: Any) -> bool:
    """Whether ``x`` is a Flax NNX optimizer (without importing Flax: a program that made one
    has imported it)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Optimizer)


def _opt_state(state: Any) -> Any:
    return state.opt_state if _nnx_optimizer(state) else state


def _scale(state: Any) -> jax.Array:
    """The scale array of an optimizer state or NNX optimizer (an NNX Variable's value)."""
    return jnp.asarray(get_loss_scale_state(_opt_state(state)).scale)


def value_and_grad(
    fun: Callable[..., Any],
    opt_state: Any,
    *,
    argnums: Any = 0,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """``jax.value_and_grad`` of the scaled loss: the loss as ``fun`` returns it, the
    gradients scaled, ready for ``tx.update``.

    Rule (``value_and_grad(fun, opt_state)(*args, **kwargs)``)::

      loss, aux = fun(*args, **kwargs)            # (loss, aux) if has_aux, else loss
      grads = d scale_loss(loss, opt_state) / d args[argnums]
      return (loss, aux) if has_aux else loss, grads

    ``fun`` returns the plain loss (a floating scalar, float16 included): scaling it in
    ``fun`` as well would scale it twice (refused while traced). ``opt_state`` is the
    optimizer state ``tx.update`` will be given in the same step; under ``jit`` pass the
    step's argument, not a state captured from outside (its scale would be a constant of
    the trace, also refused).

    Given a Flax NNX optimizer (``lsj.LossScaleOptimizer``, or any ``nnx.Optimizer`` whose
    transformation is loss-scaled) instead of a state, it differentiates with
    ``nnx.value_and_grad`` (``argnums`` may be an ``nnx.DiffState``) and reads
    ``optimizer.opt_state`` when called; the returned function keeps ``fun``'s signature
    (``inspect.signature``), so a trainer that binds arguments by name sees ``fun``'s.

    Args:
      fun: the loss function.
      opt_state: the optimizer state holding the ``LossScaleState`` (as ``scale_loss``
        takes it), or an NNX optimizer.
      argnums: which positional arguments to differentiate (as ``jax.value_and_grad``, or
        ``nnx.value_and_grad`` for an NNX optimizer).
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      A function of ``fun``'s arguments returning ``(value, grads)``: ``value`` is ``loss``
      or ``(loss, aux)``, unscaled, in ``fun``'s dtype; ``grads`` are scaled (divide them by
      the scale only through ``tx.update``; ``unscaled_global_norm`` gives their norm).

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> params = {"w": jnp.ones(3)}
      >>> tx = lsj.loss_scaling(optax.sgd(0.1), lsj.StaticScale(2.0**10))
      >>> opt_state = tx.init(params)
      >>> loss_fn = lambda p, x: jnp.sum((p["w"] * x) ** 2)
      >>> loss, grads = lsj.value_and_grad(loss_fn, opt_state)(params, jnp.ones(3))
      >>> float(loss), grads["w"].tolist()                    # the loss; scaled gradients
      (3.0, [2048.0, 2048.0, 2048.0])
      >>> float(lsj.unscaled_global_norm(grads, opt_state))    # |(2, 2, 2)|
      3.464...
      >>> updates, opt_state = tx.update(grads, opt_state, params)
    """
    if not callable(fun):
        raise TypeError(f"fun must be callable, got {fun!r}.")
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux must be a bool, got {has_aux!r}.")
    nnx_optimizer = _nnx_optimizer(opt_state)
    _scale(opt_state)  # refuses a state without a LossScaleState, here

    @functools.wraps(fun)
    def scaled(*args: Any, **kwargs: Any) -> tuple[jax.Array, Any]:
        out = fun(*args, **kwargs)
        loss, aux = out if has_aux else (out, None)
        return scale_loss(loss, _opt_state(opt_state)), (loss, aux)

    if nnx_optimizer:  # Flax is loaded: the optimizer is its
        nnx = sys.modules["flax.nnx"]
        differentiate = nnx.value_and_grad(scaled, argnums=argnums, has_aux=True)
    else:
        check_argnums(argnums)
        differentiate = jax.value_and_grad(scaled, argnums=argnums, has_aux=True)

    @functools.wraps(fun)
    def run(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        (_, (loss, aux)), grads = differentiate(*args, **kwargs)
        refuse_scaled_twice(grads, _scale(opt_state))
        return ((loss, aux) if has_aux else loss), grads

    return run


def unscaled_global_norm(grads: optax.Updates, opt_state: Any) -> jax.Array:
    """The global norm of the gradients unscaled, in float32: what a trainer logs.

    Rule::

      sqrt(sum over floating leaves of sum((g / scale) ** 2))   # in float32

    ``grads`` are the scaled gradients (``value_and_grad``'s, or those of ``scale_loss``) and
    ``opt_state`` the state they were scaled with (the one ``tx.update`` is given, not the one
    it returns). On a step whose gradients overflowed the norm is inf or nan, as the
    gradients are: log it beside ``lsj.metrics(...)["skipped"]``.

    Args:
      grads: the scaled gradients.
      opt_state: the optimizer state holding the ``LossScaleState``, or an NNX optimizer.

    Returns:
      A float32 scalar.
    """
    inv = inverse(_scale(opt_state))
    leaves = [g for g in jax.tree_util.tree_leaves(grads) if is_float(g)]
    squares = [jnp.sum(jnp.square(g.astype(jnp.float32) * inv)) for g in leaves]
    return jnp.sqrt(sum(squares, jnp.zeros([], jnp.float32)))
