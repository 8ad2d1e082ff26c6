"""The Flax-shaped ``DynamicScale``: a pytree with ``value_and_grad``, ``scale``, ``fin_steps``.

Flax code that keeps the object in its ``TrainState`` and calls
``dynamic_scale.value_and_grad(loss_fn, has_aux=True, axis_name="batch")`` runs with
``compat.flax.DynamicScale`` in its place. The scale's rule is the policy of
``compat.flax.dynamic_scale_policy``, stepped by the engine (``Engine.check`` and
``Engine.decide``); ``scale`` and ``fin_steps`` are that policy's ``scale`` and
``growth_count``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _F32_MAX,
    _TINY,
    _build,
    _int,
    _number,
)
from lossscale_jax.engine._engine import Engine
from lossscale_jax.engine._state import initial_state

_NUMBERS = (bool, int, float, np.generic)


def dynamic_scale_policy(
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    scale: float = 65536.0,
    minimum_scale: float | None = _TINY,
) -> policies.DynamicScale:
    """Flax's ``DynamicScale`` rule as a policy; it grows one step later than the others.

    Rule (``DynamicScale.value_and_grad``)::

      grow = fin_steps == growth_interval
      if finite:
          if grow: scale = min(scale * growth_factor, float32 max)
      else:
          scale = max(scale * backoff_factor, minimum_scale)
      fin_steps = 0 if grow or not finite else fin_steps + 1

    The growth comes on the ``growth_interval + 1``-th good step, so this
    is ``DynamicScale(growth_interval=growth_interval + 1)``, and a growth
    past float32 clamps to its largest number (``growth_overflow="clamp"``).
    ``minimum_scale=None`` (no floor) stops at ``2**-126`` here.

    Pass it to ``lsj.loss_scaling`` (the native step, with ``lsj.TrainState``);
    ``compat.flax.DynamicScale`` is the Flax-shaped object that runs it.

    Examples:
      >>> from lossscale_jax import compat
      >>> compat.flax.dynamic_scale_policy(growth_interval=10).growth_interval
      11
    """
    interval = _int("growth_interval", growth_interval)
    if interval < 0:
        raise ValueError(f"growth_interval must be >= 0, got {growth_interval!r}.")
    lo = _TINY if minimum_scale is None else _number("minimum_scale", minimum_scale)
    return _build(
        policies.DynamicScale,
        {"init_scale": "scale", "min_scale": "minimum_scale"},
        init_scale=_number("scale", scale),
        growth_factor=_number("growth_factor", growth_factor),
        backoff_factor=_number("backoff_factor", backoff_factor),
        growth_interval=interval + 1,
        min_scale=lo,
        max_scale=_F32_MAX,
        growth_overflow="clamp",
    )


class DynamicScaleResult(NamedTuple):
    """What ``DynamicScale.value_and_grad``'s function returns (Flax's field names)."""

    dynamic_scale: DynamicScale
    finite: jax.Array
    aux: Any
    grad: Any


def _as(value: Any, dtype: Any) -> Any:
    """A Python or NumPy number as a 0-d array of ``dtype``; anything else as it is.

    Arrays and tracers pass unchanged, and so do the placeholders JAX builds a
    pytree with (``object()``), so the pytree's unflattening stays exact.
    """
    return jnp.asarray(value, dtype) if isinstance(value, _NUMBERS) else value


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["fin_steps", "scale"],
    meta_fields=["growth_factor", "backoff_factor", "growth_interval", "minimum_scale"],
)
@dataclasses.dataclass(frozen=True)
class DynamicScale:
    """Flax's ``flax.training.dynamic_scale.DynamicScale``, in this library.

    A pytree (leaves ``fin_steps`` int32 and ``scale`` float32; the other
    fields are static) with Flax's fields, defaults and ``value_and_grad``:
    Flax's train steps run unchanged with it in the ``TrainState``, bit for
    bit. The function ``value_and_grad`` returns computes, as Flax does::

      value, grad = jax.value_and_grad(lambda *a: scale * fun(*a))(*args)
      value = value / scale
      grad = pmean(float32(grad) / scale, axis_name)       # if axis_name
      finite = all(isfinite(grad))
      scale, fin_steps = compat.flax.dynamic_scale_policy(...) stepped on not finite

    Differences from Flax: the scale and counter are float32 and int32 arrays
    from the start (Flax starts from Python numbers, so its step traces twice
    and, with a float16 loss, multiplies the first step's loss in float16), and
    ``minimum_scale=None`` stops at ``2**-126``. ``policy`` is the rule as a
    policy, for the native step (``lsj.loss_scaling``, ``lsj.TrainState``).

    Args:
      growth_factor: how much to grow the scale after ``growth_interval`` good
        steps (default 2).
      backoff_factor: how much to shrink it after a non-finite gradient
        (default 0.5).
      growth_interval: good steps in a row before a growth (default 2000; the
        growth comes on the next good step, as in Flax).
      fin_steps: good steps in a row so far (default 0).
      scale: the current scale (default ``2**16``).
      minimum_scale: the floor of the scale (default ``2**-126``).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from lossscale_jax import compat
      >>> ds = compat.flax.DynamicScale(growth_interval=10)
      >>> loss_fn = lambda p: p**2
      >>> step = jax.jit(lambda ds, p: ds.value_and_grad(loss_fn)(p))
      >>> ds, is_fin, loss, grad = step(ds, jnp.float32(1.0))
      >>> bool(is_fin), float(grad), float(ds.scale), int(ds.fin_steps)
      (True, 2.0, 65536.0, 1)
      >>> ds, is_fin, loss, grad = step(ds, jnp.float32(jnp.inf))   # an overflow
      >>> bool(is_fin), float(ds.scale), int(ds.fin_steps)
      (False, 32768.0, 0)
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    fin_steps: Any = 0
    scale: Any = 65536.0
    minimum_scale: float | None = _TINY

    def __post_init__(self) -> None:
        self.policy  # noqa: B018  (checks the hyperparameters, naming the bad one)
        object.__setattr__(self, "fin_steps", _as(self.fin_steps, jnp.int32))
        object.__setattr__(self, "scale", _as(self.scale, jnp.float32))

    @property
    def policy(self) -> policies.DynamicScale:
        """The rule as a policy (``compat.flax.dynamic_scale_policy``), for ``lsj.loss_scaling``.

        Its ``init_scale`` is this object's ``scale`` when that is a concrete number
        inside the bounds, else ``2**16`` moved into them.
        """
        lo = _TINY if self.minimum_scale is None else self.minimum_scale
        start = 65536.0
        if not isinstance(self.scale, jax.core.Tracer) and np.shape(self.scale) == ():
            try:
                start = float(np.asarray(self.scale))
            except (TypeError, ValueError):  # a placeholder of pytree machinery
                pass
        if not np.isfinite(start) or not 0.0 < start:
            start = 65536.0
        lo_f = float(np.asarray(lo)) if isinstance(lo, _NUMBERS) else _TINY
        return dynamic_scale_policy(
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
            min(max(start, lo_f), _F32_MAX),
            self.minimum_scale,
        )

    def replace(self, **updates: Any) -> DynamicScale:
        """A copy with ``updates`` (Flax's ``struct.PyTreeNode.replace``)."""
        return dataclasses.replace(self, **updates)

    def value_and_grad(
        self,
        fun: Callable[..., Any],
        argnums: int | Sequence[int] = 0,
        has_aux: bool = False,
        axis_name: str | None = None,
    ) -> Callable[..., DynamicScaleResult]:
        """``jax.value_and_grad`` of ``fun`` with the loss scaled (Flax's method).

        Args:
          fun: the loss function; with ``has_aux``, it returns ``(loss, aux)``.
          argnums: the positional argument(s) to differentiate (default 0).
          has_aux: whether ``fun`` returns ``(loss, aux)``.
          axis_name: the ``pmap``/``shard_map`` axis to average the gradients
            over (default None: no averaging).

        Returns:
          A function of ``fun``'s arguments returning
          ``DynamicScaleResult(dynamic_scale, finite, aux, grad)``: the next
          ``DynamicScale``, whether the gradients are finite, the value (or
          ``(value, aux)``) unscaled, and the unscaled gradients (float32).
        """
        # The mean over axis_name is the same on every device, so each decides alone on
        # it (local_axes), as Flax does; under another mapped axis the engine refuses.
        # Flax's method checks the gradients it has unscaled itself: no wiring to check.
        engine = Engine.build(
            "compat.flax.DynamicScale.value_and_grad",
            self.policy,
            local_axes=axis_name,
            attribution=None,
            check_wiring=False,
        )
        scale = self.scale

        @functools.wraps(fun)
        def loss_wrapper(*args: Any) -> Any:
            out = fun(*args)
            return (scale * out[0], out[1]) if has_aux else scale * out

        grad_fn = jax.value_and_grad(loss_wrapper, argnums, has_aux)

        def grad_fn_wrapper(*args: Any) -> DynamicScaleResult:
            value, grad = grad_fn(*args)
            value = (value[0] / scale, value[1]) if has_aux else value / scale
            grad = jax.tree_util.tree_map(lambda g: jnp.asarray(g, jnp.float32) / scale, grad)
            if axis_name is not None:
                grad = jax.lax.pmean(grad, axis_name)
            check = engine.check(grad, jnp.asarray(scale, jnp.float32), None)
            state = initial_state(scale).replace(
                growth_count=jnp.asarray(self.fin_steps, jnp.int32)
            )
            new, _ = engine.decide(state, check)
            new_self = self.replace(fin_steps=new.growth_count, scale=new.scale)
            return DynamicScaleResult(new_self, jnp.logical_not(check.overflow), value, grad)

        return grad_fn_wrapper
