"""Megatron-LM (``megatron/core/optimizer/grad_scaler.py``)."""

from __future__ import annotations

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _INF,
    _build,
    _int,
    _number,
)
from lossscale_jax.policies import StaticScale


def DynamicGradScaler(
    initial_scale: float,
    min_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
) -> policies.DynamicScale:
    """Megatron's dynamic scaler; its hysteresis tracker is reset only by a growth.

    Rule (``DynamicGradScaler.update``, float32 tensors)::

      if found_inf:
          growth_tracker = 0
          hysteresis_tracker -= 1
          if hysteresis_tracker <= 0:
              scale = max(scale * backoff_factor, min_scale)
      else:
          growth_tracker += 1
          if growth_tracker == growth_interval:
              growth_tracker = 0; hysteresis_tracker = hysteresis
              scale = scale * growth_factor

    After ``hysteresis`` overflows every further overflow backs off until
    the next growth: ``DynamicScale(consecutive_hysteresis=False,
    sticky_hysteresis=True)``. Megatron would let a growth overflow to
    ``inf``; here it is refused.

    Args:
      initial_scale, min_scale, growth_factor, backoff_factor,
      growth_interval, hysteresis: as in Megatron (all required there).

    Returns:
      A ``DynamicScale``.

    Examples:
      >>> from lossscale_jax import compat
      >>> p = compat.megatron.DynamicGradScaler(2.0**32, 1.0, 2.0, 0.5, 1000, 2)
      >>> p.sticky_hysteresis, p.consecutive_hysteresis
      (True, False)
    """
    lo = _number("min_scale", min_scale)
    init = _number("initial_scale", initial_scale)
    if not lo > 0.0:
        raise ValueError(f"min_scale must be > 0, got {min_scale!r}.")
    if not lo <= init:
        raise ValueError(f"min_scale ({min_scale!r}) must be <= initial_scale ({initial_scale!r}).")
    return _build(
        policies.DynamicScale,
        {"init_scale": "initial_scale"},
        init_scale=init,
        growth_factor=_number("growth_factor", growth_factor),
        backoff_factor=_number("backoff_factor", backoff_factor),
        growth_interval=_int("growth_interval", growth_interval),
        hysteresis=_int("hysteresis", hysteresis),
        consecutive_hysteresis=False,
        min_scale=lo,
        max_scale=_INF,
        sticky_hysteresis=True,
    )


def ConstantGradScaler(initial_scale: float) -> StaticScale:
    """Megatron's constant scaler: the scale never changes; overflowing steps are skipped.

    Examples:
      >>> from lossscale_jax import compat
      >>> float(compat.megatron.ConstantGradScaler(4096.0).init().scale)
      4096.0
    """
    return _build(
        StaticScale, {"scale": "initial_scale"}, scale=_number("initial_scale", initial_scale)
    )
