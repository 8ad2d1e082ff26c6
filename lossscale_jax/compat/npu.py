"""Huawei Ascend ``npu_bridge`` loss scaling (TF1 ``contrib.mixed_precision`` rules).

``npu_bridge.estimator.npu.npu_loss_scale_manager`` subclasses the TF1
managers of ``tensorflow/contrib/mixed_precision/python/loss_scale_manager.py``
and keeps their update rule, except the growth near float32's largest number
(npu_bridge grows only while ``scale < 3.4e+38 / incr_ratio``; TF1 while the
grown scale is finite); ``NPULossScaleOptimizer``
(``npu_bridge/estimator/npu/npu_loss_scale_optimizer.py``) checks the
device's float-status register and, when ``is_distributed``, all-reduces
it so every device skips together.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _INF,
    _bool,
    _build,
    _check_policy,
    _int,
    _number,
)
from lossscale_jax.engine._ops import where
from lossscale_jax.numerics import OverflowMode
from lossscale_jax.policies import LossScalePolicy, LossScaleState, StaticScale
from lossscale_jax.transform import AxisName, loss_scaling

__all__ = [
    "FixedLossScaleManager",
    "ExponentialUpdateLossScaleManager",
    "NPULossScaleOptimizer",
]


def FixedLossScaleManager(loss_scale: Any, enable_overflow_check: bool = True) -> StaticScale:
    """A fixed scale; with ``enable_overflow_check`` an overflowing step is skipped.

    Rule::

      scale = loss_scale                      # never changes
      skipped = overflow and enable_overflow_check

    Args:
      loss_scale: the scale, >= 1 (the original raises "loss scale must be
        at least 1").
      enable_overflow_check: skip overflowing steps (default True).

    Returns:
      A ``StaticScale``.

    Examples:
      >>> from lossscale_jax import compat
      >>> float(compat.npu.FixedLossScaleManager(1024).init().scale)
      1024.0
    """
    scale = _number("loss_scale", loss_scale)
    if not scale >= 1.0:
        raise ValueError(f"loss_scale must be at least 1, got {loss_scale!r}.")
    check = _bool("enable_overflow_check", enable_overflow_check)
    return _build(StaticScale, {"scale": "loss_scale"}, scale=scale, skip_on_overflow=check)


# npu_loss_scale_manager.py, ``increase_loss_scale``: grow only while
# ``loss_scale < (3.4e+38) / incr_ratio`` (a Python float, compared in float32).
_NPU_GROWTH_LIMIT = 3.4e38


@dataclasses.dataclass(frozen=True)
class _NpuExponentialUpdate(policies.DynamicScale):
    """``DynamicScale`` refusing a growth once ``scale >= float32(3.4e38 / growth_factor)``."""

    def adjust(
        self, state: LossScaleState, overflow: ArrayLike, amax: ArrayLike | None = None
    ) -> LossScaleState:
        new = super().adjust(state, overflow)
        limit = jnp.asarray(np.float32(_NPU_GROWTH_LIMIT / self.growth_factor), jnp.float32)
        refused = jnp.logical_and(
            jnp.logical_not(jnp.asarray(overflow, jnp.bool_)), state.scale >= limit
        )
        return new.replace(scale=where(refused, state.scale, new.scale))


def ExponentialUpdateLossScaleManager(
    init_loss_scale: Any,
    incr_every_n_steps: int,
    decr_every_n_nan_or_inf: int = 2,
    incr_ratio: float = 2,
    decr_ratio: float = 0.8,
) -> policies.DynamicScale:
    """npu_bridge's dynamic manager: good and bad steps counted until the scale changes.

    Rule (npu_bridge's ``update_loss_scale``, float32)::

      if finite:
          if good_steps + 1 >= incr_every_n_steps:
              if scale < float32(3.4e38 / incr_ratio): scale = scale * incr_ratio
              good_steps = bad_steps = 0
          else:
              good_steps += 1                 # bad_steps are kept
      else:
          if bad_steps + 1 >= decr_every_n_nan_or_inf:
              scale = max(1, scale * decr_ratio)
              good_steps = bad_steps = 0
          else:
              bad_steps += 1; good_steps = 0

    This is ``DynamicScale(hysteresis=decr_every_n_nan_or_inf,
    consecutive_hysteresis=False, min_scale=1, max_scale=inf)`` with
    npu_bridge's growth limit. TF1 contrib's manager, which npu_bridge
    subclasses, grows instead while ``isfinite(scale * incr_ratio)``: the two
    differ only for scales within a factor ``incr_ratio`` of float32's
    largest number (TF1 can reach it, npu_bridge stops one growth short).

    Args:
      init_loss_scale: the starting scale (>= 1, the floor).
      incr_every_n_steps: good steps before a growth (int >= 1).
      decr_every_n_nan_or_inf: overflows (accumulated until the scale
        changes) before a backoff (int >= 1).
      incr_ratio: growth factor (> 1).
      decr_ratio: backoff factor in (0, 1).

    Returns:
      A ``DynamicScale``.

    Examples:
      >>> from lossscale_jax import compat
      >>> m = compat.npu.ExponentialUpdateLossScaleManager(2**32, 1000, decr_ratio=0.5)
      >>> m.hysteresis, m.consecutive_hysteresis, m.min_scale
      (2, False, 1.0)
    """
    names = {
        "init_scale": "init_loss_scale",
        "growth_interval": "incr_every_n_steps",
        "hysteresis": "decr_every_n_nan_or_inf",
        "growth_factor": "incr_ratio",
        "backoff_factor": "decr_ratio",
    }
    return _build(
        _NpuExponentialUpdate,
        names,
        init_scale=_number("init_loss_scale", init_loss_scale),
        growth_factor=_number("incr_ratio", incr_ratio),
        backoff_factor=_number("decr_ratio", decr_ratio),
        growth_interval=_int("incr_every_n_steps", incr_every_n_steps),
        hysteresis=_int("decr_every_n_nan_or_inf", decr_every_n_nan_or_inf),
        consecutive_hysteresis=False,
        min_scale=1.0,
        max_scale=_INF,
    )


def NPULossScaleOptimizer(
    opt: optax.GradientTransformation,
    loss_scale_manager: LossScalePolicy,
    is_distributed: bool = False,
    *,
    axis_name: AxisName | None = None,
    overflow: OverflowMode = "both",
) -> optax.GradientTransformationExtraArgs:
    """``opt`` with the manager's loss scaling and the NPU's saturating overflow check.

    Rule::

      overflow = any(|g| >= 65504 or not isfinite(g))   # float-status register
      if is_distributed: overflow = any(overflow over axis_name)
      scale = manager.update(overflow)
      if overflow: skip (opt's state, e.g. its step count, does not advance)
      else:        opt.update(g / scale)

    Saturation-mode devices write +-65504 instead of inf; the float-status
    register also flags invalid operations, hence ``overflow="both"``.

    Args:
      opt: the inner optax transformation.
      loss_scale_manager: ``npu.FixedLossScaleManager(...)`` or
        ``npu.ExponentialUpdateLossScaleManager(...)`` (any policy).
      is_distributed: reduce the overflow flag across devices (needs
        ``axis_name`` under ``pmap``/``shard_map``; under ``jit`` with
        sharded arrays the check is global already: leave it False).
      axis_name: the ``pmap``/``shard_map`` axis to reduce over.
      overflow: the overflow check, ``"both"`` by default.

    Returns:
      A ``loss_scaling`` transformation.

    Examples:
      >>> import optax
      >>> from lossscale_jax import compat
      >>> tx = compat.npu.NPULossScaleOptimizer(
      ...     optax.adam(1e-3),
      ...     compat.npu.ExponentialUpdateLossScaleManager(
      ...         init_loss_scale=2**32, incr_every_n_steps=1000,
      ...         decr_every_n_nan_or_inf=2, decr_ratio=0.5))
    """
    manager = _check_policy("loss_scale_manager", loss_scale_manager)
    distributed = _bool("is_distributed", is_distributed)
    if distributed and axis_name is None:
        raise ValueError(
            "is_distributed=True needs axis_name, the pmap/shard_map axis over which the "
            "overflow flag is reduced (under jit with sharded arrays the check is already "
            "global: use is_distributed=False)."
        )
    if not distributed and axis_name is not None:
        raise ValueError(f"axis_name={axis_name!r} is only used with is_distributed=True.")
    return loss_scaling(opt, manager, overflow=overflow, axis_name=axis_name)
