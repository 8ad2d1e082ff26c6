# pyright: reportMissingImports=false
# (EasyDeL is an optional dependency: the type check runs without it installed.)
"""The loss-scaled copy of an EasyDeL training step.

EasyDeL's step functions take ``jax.value_and_grad(loss_fn, has_aux=True)`` and hand it to
``minibatch_call`` with the state (which runs it once, or over the accumulation window in a
``lax.scan``, summing the gradients), then call ``update_state_respectfully`` with the
gradients and ``update_metrics``' metrics (``_seams``). :func:`scaled_step` returns the same
function (its code, defaults and closure) with three of the names it reads rebound, for it
alone:

- ``jax.value_and_grad(loss_fn, has_aux)`` is deferred: ``minibatch_call`` binds it to the
  state's optimizer state, which makes it ``lsj.value_and_grad`` of the scaled loss. Every
  micro-batch of a window is scaled by the same scale; one that overflows makes the summed
  gradients inf or nan, and the loss-scaled optimizer skips the whole window's update;
- ``update_state_respectfully`` (which applies the update through ``state.tx``, the
  loss-scaled optimizer) also writes the gradient norms EasyDeL logs from the unscaled
  gradients (``max_grad_norm``, ``mean_grad_norm``, ``grad_norms``) and the loss scale's
  metrics into ``metrics.other_metrics``, which EasyDeL logs beside its own.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

import jax

from lossscale_jax.errors import IntegrationError
from lossscale_jax.integrations._host import _grad, _metrics


class _Deferred:
    """``jax.value_and_grad(fun, ...)`` as a step wrote it, bound by ``minibatch_call`` to
    the step's optimizer state."""

    def __init__(self, fun: Callable[..., Any], argnums: Any, has_aux: bool) -> None:
        self.fun, self.argnums, self.has_aux = fun, argnums, has_aux

    def bind(self, opt_state: Any) -> Callable[..., Any]:
        return _grad.scaled(self.fun, opt_state, has_aux=self.has_aux, argnums=self.argnums)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise IntegrationError(
            "lossscale_jax.integrations.easydel: this EasyDeL step calls its gradient "
            "function outside minibatch_call, where the integration cannot give it the "
            "loss scale. Train this trainer without enable()."
        )


class _Jax(types.ModuleType):
    """``jax`` as the step sees it: everything as it is but ``value_and_grad``."""

    def __init__(self) -> None:
        super().__init__("jax")

    def __getattr__(self, name: str) -> Any:
        return getattr(jax, name)

    @staticmethod
    def value_and_grad(
        fun: Callable[..., Any], argnums: Any = 0, has_aux: bool = False, **kwargs: Any
    ) -> Any:
        if kwargs:
            return jax.value_and_grad(fun, argnums, has_aux, **kwargs)
        return _Deferred(fun, argnums, has_aux)


#: The key of what the step says of itself for the log (``_metrics.why``) in its
#: ``other_metrics``; the trainer's hook takes it out before EasyDeL logs them.
WHY = _metrics.PREFIX + "why"


def scaled_step(
    step: types.FunctionType, update_metrics: Callable[..., Any], leaves: _metrics.Leaves
) -> Any:
    """The loss-scaled copy of the EasyDeL step function ``step`` (the module's docstring);
    ``leaves`` notes the gradient leaves' paths when it is traced."""
    names = step.__globals__
    minibatch_call, update_state = names["minibatch_call"], names["update_state_respectfully"]

    def scaled_minibatch_call(*args: Any, **kwargs: Any) -> Any:
        bound = _bind(minibatch_call, args, kwargs)
        grad_fn = bound["grad_fn"]
        if isinstance(grad_fn, _Deferred):
            bound["grad_fn"] = grad_fn.bind(bound["state"].opt_state)
        return minibatch_call(**bound)

    def scaled_update_state(*args: Any, **kwargs: Any) -> Any:
        bound = _bind(update_state, args, kwargs)
        state, metrics = bound["state"], bound["metrics"]
        used = _metrics.scale_used(state.opt_state)  # before the update
        leaves.note(bound["gradients"])
        plain = _grad.unscaled(bound["gradients"], state.opt_state)
        update_metrics(metrics=metrics, learning_rate_fn=None, step=state.step, gradients=plain)
        new = update_state(**bound)
        own = _metrics.scale_metrics(new.opt_state, used)
        own[WHY] = _metrics.why(metrics.loss, new.opt_state, used)
        metrics.other_metrics = {**(metrics.other_metrics or {}), **own}
        return new

    rebound = {
        **names,
        "jax": _Jax(),
        "minibatch_call": scaled_minibatch_call,
        "update_state_respectfully": scaled_update_state,
    }
    copy = types.FunctionType(
        step.__code__, rebound, step.__name__, step.__defaults__, step.__closure__
    )
    copy.__kwdefaults__ = step.__kwdefaults__
    copy.__qualname__ = step.__qualname__
    copy.__module__ = step.__module__
    copy.__doc__ = step.__doc__
    copy.__wrapped__ = step  # pyright: ignore[reportFunctionMemberAccess]
    return copy


def _bind(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict:
    return dict(inspect.signature(fn).bind(*args, **kwargs).arguments)
