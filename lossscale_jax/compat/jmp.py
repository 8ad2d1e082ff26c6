"""DeepMind jmp (``jmp/_src/loss_scale.py``)."""

from __future__ import annotations

from typing import Any

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _INF,
    _build,
    _int,
    _number,
)
from lossscale_jax.policies import NoScale, StaticScale


def DynamicLossScale(
    loss_scale: Any,
    period: int = 2000,
    factor: int = 2,
    min_loss_scale: Any = 1.0,
) -> policies.DynamicScale:
    """jmp's ``DynamicLossScale``.

    Rule (``DynamicLossScale.adjust``)::

      if grads_finite:
          if counter == period - 1:
              loss_scale = first_finite(loss_scale * factor, loss_scale)
          counter = (counter + 1) % period
      else:
          loss_scale = max(min_loss_scale, loss_scale / factor); counter = 0

    Unlike jmp, ``min_loss_scale`` survives ``jit`` (jmp's pytree
    flattening drops it and falls back to 1). jmp divides by ``factor``;
    here the scale is multiplied by ``1 / factor``, the same float32
    number for power-of-two factors (the default 2).

    Examples:
      >>> import jax.numpy as jnp
      >>> from lossscale_jax import compat
      >>> compat.jmp.DynamicLossScale(jnp.asarray(2.0**15), period=100).growth_interval
      100
    """
    f = _number("factor", factor)
    if not f > 1.0:
        raise ValueError(f"factor must be > 1, got {factor!r}.")
    return _build(
        policies.DynamicScale,
        {
            "init_scale": "loss_scale",
            "growth_interval": "period",
            "min_scale": "min_loss_scale",
            "growth_factor": "factor",
        },
        init_scale=_number("loss_scale", loss_scale),
        growth_factor=f,
        backoff_factor=1.0 / f,
        growth_interval=_int("period", period),
        min_scale=_number("min_loss_scale", min_loss_scale),
        max_scale=_INF,
    )


def StaticLossScale(loss_scale: Any) -> StaticScale:
    """jmp's ``StaticLossScale``: a fixed scale (overflowing steps are skipped).

    Examples:
      >>> from lossscale_jax import compat
      >>> float(compat.jmp.StaticLossScale(128.0).init().scale)
      128.0
    """
    return _build(StaticScale, {"scale": "loss_scale"}, scale=_number("loss_scale", loss_scale))


def NoOpLossScale() -> NoScale:
    """jmp's ``NoOpLossScale``: no scaling.

    Examples:
      >>> from lossscale_jax import compat
      >>> float(compat.jmp.NoOpLossScale().init().scale)
      1.0
    """
    return NoScale()
