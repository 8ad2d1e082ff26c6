"""MindSpore (``mindspore/train/loss_scale_manager.py``, ``nn/wrap/loss_scale.py``)."""

from __future__ import annotations

import numpy as np

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _INF,
    _bool,
    _build,
    _int,
    _number,
)
from lossscale_jax.policies import StaticScale

__all__ = [
    "DynamicLossScaleManager",
    "FixedLossScaleManager",
]


def DynamicLossScaleManager(
    init_loss_scale: float = 2**24,
    scale_factor: float = 2,
    scale_window: int = 2000,
) -> policies.DynamicScale:
    """MindSpore's dynamic manager (its ``DynamicLossScaleUpdateCell``).

    Rule (``DynamicLossScaleUpdateCell.construct``, float32)::

      if overflow:
          scale = max(scale * reciprocal(scale_factor), 1)
      should_inc = cur_iter - last_overflow_iter >= scale_window
      if overflow or should_inc: last_overflow_iter = cur_iter
      if should_inc and not overflow: scale = scale * scale_factor
      cur_iter += 1

    A growth after ``scale_window`` good steps, a floor of 1. MindSpore
    would let a growth overflow to ``inf``; here it is refused.

    Args:
      init_loss_scale: the starting scale (>= 1).
      scale_factor: growth factor; backoff multiplies by its float32
        reciprocal.
      scale_window: good steps before a growth (int >= 1).

    Returns:
      A ``DynamicScale``.

    Examples:
      >>> from lossscale_jax import compat
      >>> float(compat.mindspore.DynamicLossScaleManager().init().scale)
      16777216.0
    """
    init = _number("init_loss_scale", init_loss_scale)
    if init < 1.0:
        raise ValueError(f"init_loss_scale must be >= 1, got {init_loss_scale!r}.")
    window = _int("scale_window", scale_window)
    if window <= 0:
        raise ValueError(f"scale_window must be a positive int, got {scale_window!r}.")
    factor = _number("scale_factor", scale_factor)
    if factor <= 0:
        raise ValueError(f"scale_factor must be > 0, got {scale_factor!r}.")
    if not factor > 1.0:
        raise ValueError(
            f"scale_factor must be > 1 for the scale to grow and shrink, got {scale_factor!r}."
        )
    reciprocal = float(np.float32(1.0) / np.float32(factor))
    return _build(
        policies.DynamicScale,
        {"init_scale": "init_loss_scale", "growth_interval": "scale_window"},
        init_scale=init,
        growth_factor=factor,
        backoff_factor=reciprocal,
        growth_interval=window,
        min_scale=1.0,
        max_scale=_INF,
    )


def FixedLossScaleManager(
    loss_scale: float = 128.0, drop_overflow_update: bool = True
) -> StaticScale:
    """MindSpore's fixed manager: a fixed scale; overflowing steps dropped if asked.

    Rule::

      scale = loss_scale
      skipped = overflow and drop_overflow_update

    Examples:
      >>> from lossscale_jax import compat
      >>> compat.mindspore.FixedLossScaleManager(1024, False).skip_on_overflow
      False
    """
    scale = _number("loss_scale", loss_scale)
    if scale < 1.0:
        raise ValueError(f"loss_scale must be >= 1, got {loss_scale!r}.")
    return _build(
        StaticScale,
        {"scale": "loss_scale"},
        scale=scale,
        skip_on_overflow=_bool("drop_overflow_update", drop_overflow_update),
    )
