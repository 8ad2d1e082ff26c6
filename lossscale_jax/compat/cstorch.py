"""Cerebras ``cerebras.pytorch.amp`` (``cerebras/pytorch/amp/grad_scaler.py``)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from lossscale_jax.compat._common import (
    _build,
    _check_policy,
    _int,
    _number,
)
from lossscale_jax.numerics import OverflowMode
from lossscale_jax.policies import LossScalePolicy, StaticScale, TolerantDynamicScale
from lossscale_jax.transform import AxisName, loss_scaling

__all__ = [
    "GradScaler",
    "optimizer_step",
]


def _cerebras_clip(max_gradient_norm: float) -> optax.GradientTransformation:
    """``torch.nn.utils.clip_grad_norm_`` as Cerebras uses it: ``g * min(1, m / (norm + 1e-6))``."""

    def update_fn(updates, state, params=None):
        del params
        leaves = [
            g
            for g in jax.tree_util.tree_leaves(updates)
            if jnp.issubdtype(jnp.asarray(g).dtype, jnp.floating)
        ]
        sq = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves)
        norm = jnp.sqrt(jnp.asarray(sq, jnp.float32))
        coef = jnp.float32(max_gradient_norm) / (norm + jnp.float32(1e-6))
        coef = jnp.minimum(coef, jnp.float32(1.0))
        clipped = jax.tree_util.tree_map(
            lambda g: (g * coef).astype(g.dtype) if jnp.issubdtype(g.dtype, jnp.floating) else g,
            updates,
        )
        return clipped, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def GradScaler(
    loss_scale: Any = None,
    init_scale: float | None = None,
    steps_per_increase: int | None = None,
    min_loss_scale: float | None = None,
    max_loss_scale: float | None = None,
    overflow_tolerance: float = 0.0,
    max_gradient_norm: float | None = None,
    *,
    half_dtype: str = "float16",
) -> LossScalePolicy:
    """Cerebras's ``GradScaler``: back off when the overflow rate exceeds a tolerance.

    Rule (``GradScaler.update_scale``; counters since the last rescale)::

      steps += 1; overflows += not isfinite
      if overflows / steps > overflow_tolerance:   # float32
          scale /= 2; steps = overflows = 0
      if steps > steps_per_increase:
          scale *= 2; steps = overflows = 0
      scale = clip(scale, min_loss_scale, max_loss_scale)

    Every non-finite step is skipped (``step_if_finite``). Defaults as in
    Cerebras (an unset or zero argument takes its default):
    ``init_scale = max_loss_scale = 2**15`` (``2**31`` for
    ``half_dtype="cbfloat16"``), ``steps_per_increase=2000``,
    ``min_loss_scale=2**-14``. A numeric ``loss_scale`` is static and
    never skips. This is ``TolerantDynamicScale(growth_interval=
    steps_per_increase + 1)`` started at ``min(max_loss_scale, init_scale)``.

    ``max_gradient_norm`` (deprecated in Cerebras in favour of clipping in
    ``optimizer_step``) cannot live in a policy: pass it to
    ``cstorch.optimizer_step``, which clips in the same step.

    Returns:
      A ``TolerantDynamicScale`` or ``StaticScale(skip_on_overflow=False)``.

    Examples:
      >>> from lossscale_jax import compat
      >>> p = compat.cstorch.GradScaler(loss_scale="dynamic", overflow_tolerance=0.05)
      >>> p.growth_interval, p.min_scale, p.max_scale
      (2001, 6.103515625e-05, 32768.0)
    """
    if half_dtype not in ("float16", "bfloat16", "cbfloat16"):
        raise ValueError(
            f"half_dtype must be 'float16', 'bfloat16' or 'cbfloat16', got {half_dtype!r}."
        )
    if max_gradient_norm is not None:
        raise ValueError(
            "max_gradient_norm: a loss-scale policy does not clip; pass max_gradient_norm "
            "to compat.cstorch.optimizer_step(optimizer, grad_scaler, max_gradient_norm=...)."
        )
    default_max = 2.0**31 if half_dtype == "cbfloat16" else 2.0**15
    loss_scale = loss_scale if loss_scale else 1.0
    if isinstance(loss_scale, str):
        if loss_scale != "dynamic":
            raise ValueError(f"loss_scale must be 'dynamic' or a number, got {loss_scale!r}.")
    else:
        return _build(
            StaticScale,
            {"scale": "loss_scale"},
            scale=_number("loss_scale", loss_scale),
            skip_on_overflow=False,
        )
    init = _number("init_scale", init_scale) if init_scale else default_max
    steps = _int("steps_per_increase", steps_per_increase) if steps_per_increase else 2000
    lo = _number("min_loss_scale", min_loss_scale) if min_loss_scale else 2.0**-14
    hi = _number("max_loss_scale", max_loss_scale) if max_loss_scale else default_max
    if lo < 2.0**-14:
        raise ValueError(f"min_loss_scale too small: must be >= 2**-14, got {min_loss_scale!r}.")
    tol = _number("overflow_tolerance", overflow_tolerance)
    if tol < 0:
        raise ValueError(
            f"overflow_tolerance (the loss scaling counter threshold) must be >= 0, "
            f"got {overflow_tolerance!r}."
        )
    names = {
        "init_scale": "init_scale",
        "min_scale": "min_loss_scale",
        "max_scale": "max_loss_scale",
        "growth_interval": "steps_per_increase",
    }
    return _build(
        TolerantDynamicScale,
        names,
        init_scale=min(hi, init),
        growth_interval=steps + 1,
        overflow_tolerance=min(tol, 1.0),
        min_scale=lo,
        max_scale=hi,
    )


def optimizer_step(
    optimizer: optax.GradientTransformation,
    grad_scaler: LossScalePolicy,
    max_gradient_norm: float | None = None,
    max_gradient_value: float | None = None,
    *,
    overflow: OverflowMode = "ieee",
    axis_name: AxisName | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Cerebras's ``optimizer_step``: unscale, clip, skip non-finite steps, update the scale.

    Rule (``cerebras/pytorch/amp/optimizer_step.py``)::

      g = g / scale
      if max_gradient_norm: g = g * min(1, max_gradient_norm / (norm(g) + 1e-6))
      elif max_gradient_value: g = clip(g, -max_gradient_value, max_gradient_value)
      if finite: optimizer.step(g)              # else skipped
      grad_scaler.update()

    The clip runs inside the good branch, on the unscaled gradients.

    Args:
      optimizer: the inner optax transformation.
      grad_scaler: ``cstorch.GradScaler(...)`` (any policy).
      max_gradient_norm: global-norm clipping threshold (>= 0) or None.
      max_gradient_value: value clipping threshold (>= 0) or None; not
        both.
      overflow: the overflow check (default ``"ieee"``).
      axis_name: ``pmap``/``shard_map`` axis for the overflow reduction.

    Returns:
      A ``loss_scaling`` transformation.

    Examples:
      >>> import optax
      >>> from lossscale_jax import compat
      >>> tx = compat.cstorch.optimizer_step(
      ...     optax.adamw(1e-4), compat.cstorch.GradScaler(loss_scale="dynamic"),
      ...     max_gradient_norm=1.0)
    """
    policy = _check_policy("grad_scaler", grad_scaler)
    if max_gradient_norm is not None and max_gradient_value is not None:
        raise ValueError(
            f"Gradients can be clipped by norm(={max_gradient_norm}) or by "
            f"value(={max_gradient_value}), but not both."
        )
    inner = optimizer
    if max_gradient_norm is not None:
        norm = _number("max_gradient_norm", max_gradient_norm)
        if not (math.isfinite(norm) and norm >= 0.0):
            raise ValueError(
                f"max_gradient_norm has to be a non-negative float, got {max_gradient_norm!r}."
            )
        inner = optax.chain(_cerebras_clip(norm), optimizer)
    elif max_gradient_value is not None:
        value = _number("max_gradient_value", max_gradient_value)
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(
                f"max_gradient_value has to be a non-negative float, got {max_gradient_value!r}."
            )
        inner = optax.chain(optax.clip(value), optimizer)
    return loss_scaling(inner, policy, overflow=overflow, axis_name=axis_name)
