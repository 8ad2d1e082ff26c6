"""Flax (``flax/training/dynamic_scale.py``)."""

from __future__ import annotations

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _F32_MAX,
    _TINY,
    _build,
    _int,
    _number,
)


def DynamicScale(
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    scale: float = 65536.0,
    minimum_scale: float | None = _TINY,
) -> policies.DynamicScale:
    """Flax's ``DynamicScale``; it grows one step later than the others.

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

    Examples:
      >>> from lossscale_jax import compat
      >>> compat.flax.DynamicScale(growth_interval=10).growth_interval
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
