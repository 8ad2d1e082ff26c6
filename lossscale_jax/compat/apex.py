"""NVIDIA apex ``amp`` loss scaling (``apex/amp/scaler.py``, ``LossScaler``)."""

from __future__ import annotations

from typing import Any

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _TINY,
    _build,
    _int,
    _number,
)
from lossscale_jax.policies import LossScalePolicy, StaticScale


def LossScaler(
    loss_scale: Any = "dynamic",
    init_scale: float = 2.0**16,
    scale_window: int = 2000,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
) -> LossScalePolicy:
    """apex's ``LossScaler``: halve on overflow, double after ``scale_window`` good steps.

    Rule (``LossScaler.update_scale``)::

      if overflow and dynamic:
          scale = max(min_loss_scale, scale / 2) if min_loss_scale else scale / 2
          unskipped = 0                        # the step is skipped
      else:
          unskipped += 1
      if unskipped == scale_window and dynamic:
          scale = min(max_loss_scale, scale * 2); unskipped = 0

    The starting scale is ``min(max_loss_scale, init_scale)``. A numeric
    ``loss_scale`` is a static scale and apex never skips with it.
    Without ``min_loss_scale`` the scale stops at ``2**-126`` here.

    Args:
      loss_scale: ``"dynamic"`` or a number (static scale).
      init_scale: the starting dynamic scale.
      scale_window: good steps before a growth.
      min_loss_scale: floor (``None``: none).
      max_loss_scale: cap.

    Returns:
      A ``DynamicScale`` or a ``StaticScale(skip_on_overflow=False)``.

    Examples:
      >>> from lossscale_jax import compat
      >>> compat.apex.LossScaler().max_scale
      16777216.0
    """
    names = {
        "init_scale": "init_scale",
        "growth_interval": "scale_window",
        "min_scale": "min_loss_scale",
        "max_scale": "max_loss_scale",
    }
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
    hi = _number("max_loss_scale", max_loss_scale)
    lo = _TINY if not min_loss_scale else _number("min_loss_scale", min_loss_scale)
    return _build(
        policies.DynamicScale,
        names,
        init_scale=min(hi, _number("init_scale", init_scale)),
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=_int("scale_window", scale_window),
        min_scale=lo,
        max_scale=hi,
    )
