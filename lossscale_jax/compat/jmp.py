"""DeepMind jmp (``jmp/_src/loss_scale.py``).

The constructors take jmp's arguments, positions included; ``import_state``
and ``export_state`` convert a ``jmp.DynamicLossScale`` (its fields) to and
from a policy and state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _INF,
    _TINY,
    _build,
    _field,
    _has,
    _host,
    _number,
    _require_policy,
    _saved_array,
)
from lossscale_jax.policies import LossScalePolicy, LossScaleState, NoScale, StaticScale

__all__ = [
    "DynamicLossScale",
    "StaticLossScale",
    "NoOpLossScale",
    "import_state",
    "export_state",
]


@dataclasses.dataclass(frozen=True)
class _JmpDynamicLossScale(policies.DynamicScale):
    """``DynamicScale`` whose ``init()`` starts at jmp's ``counter``."""

    counter: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.counter < self.growth_interval:
            raise ValueError(
                f"counter must be in [0, period) = [0, {self.growth_interval}), got "
                f"{self.counter!r}."
            )

    def init(self) -> LossScaleState:
        return super().init().replace(growth_count=jnp.asarray(self.counter, jnp.int32))


def _whole(name: str, value: Any) -> int:
    """An int, or a number with an integral value (jmp accepts ``period=5.``)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}.")
    number = _number(name, value)
    if not number.is_integer():
        raise ValueError(f"{name} must be a whole number, got {value!r}.")
    return int(number)


def DynamicLossScale(
    loss_scale: Any,
    counter: Any = 0,
    period: int = 2000,
    factor: float = 2,
    min_loss_scale: Any = 1.0,
) -> policies.DynamicScale:
    """jmp's ``DynamicLossScale``, with jmp's positional order.

    Rule (``DynamicLossScale.adjust``)::

      if grads_finite:
          if counter == period - 1:
              loss_scale = first_finite(loss_scale * factor, loss_scale)
          counter = (counter + 1) % period
      else:
          loss_scale = max(min_loss_scale, loss_scale / factor); counter = 0

    ``counter`` is where the policy's ``init()`` starts counting (jmp's
    second field; 0 for a new run). Unlike jmp, ``min_loss_scale`` survives
    ``jit`` (jmp's pytree flattening drops it and falls back to 1), and
    ``min_loss_scale=0`` (no floor in jmp) stops at ``2**-126``. jmp divides
    by ``factor``; here the scale is multiplied by ``1 / factor``, the same
    float32 number for power-of-two factors (the default 2).

    Args:
      loss_scale: the starting scale (a number or 0-d array).
      counter: good steps already counted, in ``[0, period)``.
      period: good steps before a growth (an int, or a whole float as jmp
        accepts).
      factor: growth factor (> 1); the backoff divides by it.
      min_loss_scale: floor of the scale (>= 0; 0 means none).

    Returns:
      A ``DynamicScale``.

    Raises:
      ValueError: for ``factor <= 1``, ``min_loss_scale < 0``, a ``period`` that is not a
        whole number >= 1, or ``counter`` outside ``[0, period)``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from lossscale_jax import compat
      >>> p = compat.jmp.DynamicLossScale(jnp.float32(10), jnp.int32(3), 5., 2)
      >>> p.growth_interval, int(p.init().growth_count)
      (5, 3)
    """
    f = _number("factor", factor)
    if not f > 1.0:
        raise ValueError(f"factor must be > 1, got {factor!r}.")
    floor = _number("min_loss_scale", min_loss_scale)
    if floor < 0.0:
        raise ValueError(f"min_loss_scale must be >= 0, got {min_loss_scale!r}.")
    count = _whole("counter", counter)
    return _build(
        _JmpDynamicLossScale,
        {
            "init_scale": "loss_scale",
            "growth_interval": "period",
            "min_scale": "min_loss_scale",
            "growth_factor": "factor",
        },
        init_scale=_number("loss_scale", loss_scale),
        growth_factor=f,
        backoff_factor=1.0 / f,
        growth_interval=_whole("period", period),
        min_scale=max(floor, _TINY),
        max_scale=_INF,
        counter=count,
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


def import_state(loss_scale: Any) -> tuple[LossScalePolicy, LossScaleState]:
    """The policy and state of a jmp loss scale (the object, or a dict of its fields).

    Rule::

      DynamicLossScale(loss_scale, counter, period, factor, min_loss_scale)
          -> (compat.jmp.DynamicLossScale(same arguments), its init())
      StaticLossScale(loss_scale) -> StaticScale(loss_scale)
      NoOpLossScale() -> NoScale()

    A ``jmp.DynamicLossScale`` that went through ``jit`` has lost its
    ``min_loss_scale`` (jmp rebuilds it with 1); pass the fields as a dict to
    set it.

    Args:
      loss_scale: a ``jmp.DynamicLossScale``/``StaticLossScale``/
        ``NoOpLossScale``, or a dict with ``loss_scale`` and, for a dynamic
        one, ``counter``, ``period``, ``factor``, ``min_loss_scale`` (jmp's
        defaults when absent, except ``counter``, required).

    Returns:
      ``(policy, state)``.

    Raises:
      ValueError: for a missing entry, a saved scale that is not finite and > 0, or a
        counter outside the original's range. TypeError: for a value that is not a number.

    Examples:
      >>> import jmp, jax.numpy as jnp
      >>> from lossscale_jax import compat
      >>> saved = jmp.DynamicLossScale(jnp.float32(2.0**15), jnp.int32(7), period=100)
      >>> policy, state = compat.jmp.import_state(saved)
      >>> float(state.scale), int(state.growth_count), policy.growth_interval
      (32768.0, 7, 100)
    """
    if type(loss_scale).__name__ == "NoOpLossScale":
        policy = NoOpLossScale()
        return policy, policy.init()
    what = "the jmp loss scale"
    scale = _saved_array("loss_scale", _field(loss_scale, "loss_scale", what))
    if not _has(loss_scale, "counter"):
        policy = StaticLossScale(scale)
        return policy, policy.init()

    def get(key: str, default: Any) -> Any:
        return _field(loss_scale, key, what) if _has(loss_scale, key) else default

    policy = DynamicLossScale(
        scale,
        _saved_array("counter", _field(loss_scale, "counter", what)),
        get("period", 2000),
        get("factor", 2),
        _saved_array("min_loss_scale", get("min_loss_scale", 1.0)),
    )
    return policy, policy.init()


def export_state(policy: LossScalePolicy, state: LossScaleState) -> dict[str, Any]:
    """The fields of a ``jmp.DynamicLossScale`` for a policy and state.

    Rule::

      {"loss_scale": float32(state.scale), "counter": int32(state.growth_count),
       "period": policy.growth_interval, "factor": policy.growth_factor,
       "min_loss_scale": float32(policy.min_scale)}
      StaticScale -> {"loss_scale": float32(scale)}

    ``jmp.DynamicLossScale(**d)`` (or ``jmp.StaticLossScale(**d)``) continues
    the run in jmp.

    Args:
      policy: built by ``compat.jmp.DynamicLossScale`` (or ``StaticLossScale``).
      state: its ``LossScaleState``.

    Returns:
      A dict of jmp's field names: NumPy 0-d arrays for the arrays, Python
      numbers for ``period`` and ``factor``.

    Raises:
      ValueError: if ``policy`` is not one jmp's DynamicLossScale can express.
      TypeError: if ``state`` is not a ``LossScaleState``.

    Examples:
      >>> import jmp
      >>> from lossscale_jax import compat
      >>> p = compat.jmp.DynamicLossScale(2.0**15, period=100)
      >>> ls = jmp.DynamicLossScale(**compat.jmp.export_state(p, p.adjust(p.init(), False)))
      >>> float(ls.loss_scale), int(ls.counter), ls.period
      (32768.0, 1, 100)
    """
    scale, count, _ = _host(state)
    if isinstance(policy, StaticScale) and policy.skip_on_overflow:
        return {"loss_scale": np.float32(scale)}
    if not isinstance(policy, policies.DynamicScale):
        raise ValueError(
            f"policy {policy!r} has no jmp equivalent: export needs a policy built by "
            "compat.jmp.DynamicLossScale."
        )
    factor = float(policy.growth_factor)
    expected = DynamicLossScale(
        policy.init_scale,
        getattr(policy, "counter", 0),
        policy.growth_interval,
        factor,
        policy.min_scale,
    )
    if type(policy) is policies.DynamicScale:
        expected = policies.DynamicScale(
            **{f.name: getattr(expected, f.name) for f in dataclasses.fields(policies.DynamicScale)}
        )
    _require_policy(policy, expected, "jmp", "compat.jmp.DynamicLossScale")
    return {
        "loss_scale": np.float32(scale),
        "counter": np.int32(count),
        "period": int(policy.growth_interval),
        "factor": int(factor) if factor.is_integer() else factor,
        "min_loss_scale": np.float32(policy.min_scale),
    }
