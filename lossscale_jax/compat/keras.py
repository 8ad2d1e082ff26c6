"""Keras 3 (``keras/src/optimizers/loss_scale_optimizer.py``)."""

from __future__ import annotations

import optax

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _INF,
    _TINY,
    _build,
    _int,
    _number,
)
from lossscale_jax.transform import loss_scaling


def LossScaleOptimizer(
    inner_optimizer: optax.GradientTransformation,
    initial_scale: float = 2.0**15,
    dynamic_growth_steps: int = 2000,
) -> optax.GradientTransformationExtraArgs:
    """Keras 3's ``LossScaleOptimizer``: skip and halve on inf/nan, double after N good steps.

    Rule (``stateless_apply``)::

      if all(isfinite(grads)):
          if step_counter == dynamic_growth_steps - 1:
              scale = scale * 2; step_counter = 0
          else:
              step_counter += 1
          inner.apply(grads / scale)
      else:
          scale = scale / 2; step_counter = 0     # the step is skipped

    Keras has no bounds (its scale can reach 0 or inf); here it stays in
    ``[2**-126, float32 max]``.

    Args:
      inner_optimizer: the inner optax transformation.
      initial_scale: the starting scale.
      dynamic_growth_steps: good steps before a growth.

    Returns:
      A ``loss_scaling`` transformation (``overflow="ieee"``).

    Examples:
      >>> import optax
      >>> from lossscale_jax import compat
      >>> tx = compat.keras.LossScaleOptimizer(optax.sgd(0.1))
    """
    policy = _build(
        policies.DynamicScale,
        {"init_scale": "initial_scale", "growth_interval": "dynamic_growth_steps"},
        init_scale=_number("initial_scale", initial_scale),
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=_int("dynamic_growth_steps", dynamic_growth_steps),
        min_scale=_TINY,
        max_scale=_INF,
    )
    return loss_scaling(inner_optimizer, policy, overflow="ieee")
