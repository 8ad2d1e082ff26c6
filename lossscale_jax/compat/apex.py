"""NVIDIA apex: ``amp``'s ``LossScaler`` and the ``update_scale_hysteresis`` kernel.

``LossScaler`` is ``apex/amp/scaler.py``; ``update_scale_hysteresis`` is the
fused scale update of ``csrc/update_scale_hysteresis.cu`` (``amp_C``), used
by scalers with hysteresis built on apex.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _INF,
    _TINY,
    _build,
    _int,
    _number,
)
from lossscale_jax.policies import LossScalePolicy, StaticScale

__all__ = [
    "LossScaler",
    "update_scale_hysteresis",
]


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


@dataclasses.dataclass(frozen=True)
class _ApexHysteresisScale(policies.DynamicScale):
    """``DynamicScale`` that also takes ``growth_factor=1`` (a growth that changes nothing).

    apex's kernel accepts a factor of 1 (its tests use it); the scale then
    only ever backs off.
    """

    def __post_init__(self) -> None:
        if self.growth_factor == 1.0 and not isinstance(self.growth_factor, bool):
            # Every other field is validated as DynamicScale validates it.
            checked = dataclasses.replace(self, growth_factor=2.0)
            for f in dataclasses.fields(self):
                if f.name != "growth_factor":
                    object.__setattr__(self, f.name, getattr(checked, f.name))
            object.__setattr__(self, "growth_factor", 1.0)
        else:
            super().__post_init__()


def update_scale_hysteresis(
    init_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
) -> policies.DynamicScale:
    """apex's fused scale update with hysteresis (``amp_C.update_scale_hysteresis``).

    Rule (``update_scale_hysteresis_cuda_kernel``, float32 scale)::

      if found_inf:
          hysteresis_tracker -= 1
          if hysteresis_tracker > 0: growth_tracker = 0; return   # skipped, no backoff
          scale = scale * backoff_factor; growth_tracker = 0
      else:
          if growth_tracker + 1 == growth_interval:
              if isfinite(scale * growth_factor): scale = scale * growth_factor
              growth_tracker = 0
          else:
              growth_tracker += 1
          hysteresis_tracker = hysteresis                        # every good step

    Overflows back off only after ``hysteresis`` in a row, then every further
    one until a good step: ``DynamicScale(hysteresis=hysteresis,
    consecutive_hysteresis=True, sticky_hysteresis=True)``. A
    ``growth_factor`` of 1 is accepted, as apex accepts it. The kernel has no
    floor (its scale flushes to 0 below ``2**-126``); here the scale stops at
    ``2**-126``.

    Args:
      init_scale: the starting scale.
      growth_factor: factor >= 1 applied after ``growth_interval`` good steps.
      backoff_factor: factor in (0, 1).
      growth_interval: good steps before a growth (int >= 1).
      hysteresis: overflows in a row before a backoff (int >= 1).

    Returns:
      A ``DynamicScale``.

    Raises:
      ValueError: for ``growth_factor < 1`` or the other arguments out of ``DynamicScale``'s
        ranges.

    Examples:
      >>> from lossscale_jax import compat
      >>> p = compat.apex.update_scale_hysteresis(1024.0, 1.0, 0.5, 10, 2)
      >>> p.growth_factor, p.hysteresis, p.sticky_hysteresis
      (1.0, 2, True)
    """
    growth = _number("growth_factor", growth_factor)
    if not growth >= 1.0:
        raise ValueError(f"growth_factor must be >= 1, got {growth_factor!r}.")
    return _build(
        _ApexHysteresisScale,
        {},
        init_scale=_number("init_scale", init_scale),
        growth_factor=growth,
        backoff_factor=_number("backoff_factor", backoff_factor),
        growth_interval=_int("growth_interval", growth_interval),
        hysteresis=_int("hysteresis", hysteresis),
        consecutive_hysteresis=True,
        sticky_hysteresis=True,
        min_scale=_TINY,
        max_scale=_INF,
    )
