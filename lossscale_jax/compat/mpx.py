"""mpx, mixed precision for Equinox (``mixed-precision-for-jax``; ``mpx/_grad_tools.py``,
``mpx/_loss_scaling.py``, ``mpx/_cast.py``).

mpx's public names, with mpx's arguments (positions included) and return values:
``from lossscale_jax.compat import mpx`` runs an mpx program unchanged, bit for bit
(``DynamicLossScaling``, ``filter_value_and_grad``, ``filter_grad``,
``calculate_scaled_grad``, ``optimizer_update``, ``select_tree``, ``all_finite``,
``scaled``, the casts, ``force_full_precision``, ``cast_function``,
``half_precision_datatype``, ``set_half_precision_datatype``, and the constants
``FLOAT16_MAX`` and ``BFLOAT16_MAX``). It reproduces mpx where mpx surprises: the
gradients are unscaled with the scale after ``adjust`` (half the true gradients on a growth
step) and the loss is multiplied by the scale cast to float16 (a scale of ``2**16`` makes it
inf). The library's own step has neither: ``import_state`` turns a
``DynamicLossScaling`` into the policy and state for ``lsj.loss_scaling`` (see the porting
guide), ``export_state`` goes back. This module loads Equinox.
"""

from __future__ import annotations

import importlib.util
from typing import Any

# mpx is Equinox's, and its drop-in needs Equinox: say so before the imports below fail.
if importlib.util.find_spec("equinox") is None:
    raise ModuleNotFoundError(
        "lossscale_jax.compat.mpx needs Equinox (pip install equinox); the rest of "
        "lossscale_jax does not."
    )

import jax.numpy as jnp
import numpy as np

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _TINY,
    _build,
    _host,
    _number,
    _require_policy,
    _whole,
)
from lossscale_jax.compat._mpx_cast import (
    cast_function,
    cast_to_bfloat16,
    cast_to_float16,
    cast_to_float32,
    cast_to_full_precision,
    cast_to_half_precision,
    cast_tree,
    force_full_precision,
    half_precision_datatype,
    set_half_precision_datatype,
)
from lossscale_jax.compat._mpx_grad import (
    calculate_scaled_grad,
    filter_grad,
    filter_value_and_grad,
    optimizer_update,
    select_tree,
)
from lossscale_jax.compat._mpx_scale import _F16_MAX, DynamicLossScaling, all_finite, scaled
from lossscale_jax.policies import LossScaleState

__all__ = [
    "DynamicLossScaling",
    "all_finite",
    "calculate_scaled_grad",
    "cast_function",
    "cast_to_bfloat16",
    "cast_to_float16",
    "cast_to_float32",
    "cast_to_full_precision",
    "cast_to_half_precision",
    "cast_tree",
    "dynamic_loss_scaling_policy",
    "export_state",
    "filter_grad",
    "filter_value_and_grad",
    "force_full_precision",
    "half_precision_datatype",
    "import_state",
    "optimizer_update",
    "scaled",
    "select_tree",
    "set_half_precision_datatype",
]


def __getattr__(name: str) -> Any:
    # mpx's constants, float32 0-d arrays made on first use (as mpx makes them: no JAX
    # backend starts when the module is imported).
    if name == "FLOAT16_MAX":
        return jnp.ones([], dtype=jnp.float32) * (2 - 2 ** (-10)) * 2**15
    if name == "BFLOAT16_MAX":
        return jnp.array([((2**8 - 1) * 2 ** (120))], dtype=jnp.float32)[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dynamic_loss_scaling_policy(
    loss_scaling: Any, min_loss_scaling: Any, factor: float = 2, period: int = 2000
) -> policies.DynamicScale:
    """mpx's ``DynamicLossScaling`` rule as a policy, for ``lsj.loss_scaling``.

    Rule (the policy's ``adjust``; the scale and its counter)::

      DynamicScale(init_scale=loss_scaling, growth_factor=factor,
                   backoff_factor=1 / factor, growth_interval=period,
                   min_scale=min_loss_scaling, max_scale=65504)

    the scale sequence of mpx's ``adjust`` for the same overflows: growth every
    ``period`` good steps capped at 65504, backoff floored at ``min_loss_scaling``. It
    differs where mpx's does not hold: a ``min_loss_scaling`` of 0 stops at ``2**-126``,
    the backoff multiplies by ``1 / factor`` (mpx divides; the same float32 number for
    power-of-two factors), and a starting scale above 65504 starts at 65504 (mpx's first
    step overflows there and halves it). With ``lsj.loss_scaling`` the gradients are
    unscaled with the scale the loss was scaled with, and the loss is scaled in float32.

    Args:
      loss_scaling: the starting scale (a number or 0-d array).
      min_loss_scaling: the floor of the scale (>= 0).
      factor: the growth factor (> 1); the backoff divides by it.
      period: good steps before a growth (a whole number >= 1).

    Returns:
      A ``DynamicScale``.

    Raises:
      ValueError: for ``factor <= 1``, ``period < 1``, or a ``min_loss_scaling`` above
        65504 or below 0. TypeError: for a value that is not a number.

    Examples:
      >>> import lossscale_jax as lsj
      >>> from lossscale_jax.compat import mpx
      >>> p = mpx.dynamic_loss_scaling_policy(2.0**15, 1.0, period=2)
      >>> s = p.adjust(p.adjust(p.init(), False), False)
      >>> float(s.scale)                                    # 2**16, capped
      65504.0
    """
    f = _number("factor", factor)
    if not f > 1.0:
        raise ValueError(f"factor must be > 1, got {factor!r}.")
    floor = _number("min_loss_scaling", min_loss_scaling)
    if not 0.0 <= floor <= _F16_MAX:
        raise ValueError(f"min_loss_scaling must be in [0, 65504], got {min_loss_scaling!r}.")
    floor = max(floor, _TINY)
    start = min(max(_number("loss_scaling", loss_scaling), floor), _F16_MAX)
    return _build(
        policies.DynamicScale,
        {
            "init_scale": "loss_scaling",
            "growth_interval": "period",
            "min_scale": "min_loss_scaling",
            "growth_factor": "factor",
        },
        init_scale=start,
        growth_factor=f,
        backoff_factor=1.0 / f,
        growth_interval=_whole("period", period),
        min_scale=floor,
        max_scale=_F16_MAX,
    )


def import_state(scaling: Any) -> tuple[policies.DynamicScale, LossScaleState]:
    """The policy and state of an mpx ``DynamicLossScaling`` (mpx's or this module's).

    Rule::

      DynamicLossScaling(loss_scaling, min_loss_scaling, factor, period, counter)
          -> (dynamic_loss_scaling_policy(loss_scaling, min_loss_scaling, factor, period),
              its init() with growth_count = counter)

    ``lsj.set_loss_scale_state(tx.init(params), state)`` puts the state into a new
    optimizer state; the run continues with the scale and counter where mpx left them.

    Args:
      scaling: a ``DynamicLossScaling`` (read on the host; not inside ``jit``).

    Returns:
      ``(policy, state)``.

    Raises:
      ValueError: for a counter outside ``[0, period)`` and the values
        ``dynamic_loss_scaling_policy`` refuses.

    Examples:
      >>> import jax.numpy as jnp
      >>> from lossscale_jax.compat import mpx
      >>> s = mpx.DynamicLossScaling(jnp.float32(2.0**14), jnp.float32(1.0), period=100)
      >>> policy, state = mpx.import_state(s.adjust(jnp.array(True)))
      >>> float(state.scale), int(state.growth_count), policy.growth_interval
      (16384.0, 1, 100)
    """
    fields = ("loss_scaling", "min_loss_scaling", "counter", "factor", "period")
    missing = [f for f in fields if not hasattr(scaling, f)]
    if missing:
        raise TypeError(
            f"scaling must be an mpx DynamicLossScaling, got {type(scaling).__name__} "
            f"(no {', '.join(missing)})."
        )
    policy = dynamic_loss_scaling_policy(
        np.asarray(scaling.loss_scaling),
        np.asarray(scaling.min_loss_scaling),
        _number("factor", np.asarray(scaling.factor)),
        _whole("period", np.asarray(scaling.period)),
    )
    counter = _whole("counter", np.asarray(scaling.counter))
    if not 0 <= counter < policy.growth_interval:
        raise ValueError(
            f"counter must be in [0, period) = [0, {policy.growth_interval}), got {counter}."
        )
    state = policy.init()
    return policy, state.replace(growth_count=jnp.asarray(counter, jnp.int32))


def export_state(policy: policies.DynamicScale, state: LossScaleState) -> dict[str, Any]:
    """The arguments of an mpx ``DynamicLossScaling`` for a policy and state.

    Rule::

      {"loss_scaling": float32(state.scale), "min_loss_scaling": float32(min_scale),
       "factor": growth_factor, "period": growth_interval,
       "counter": int32(state.growth_count)}

    ``mpx.DynamicLossScaling(**d)`` continues the run in mpx (or this module).

    Args:
      policy: built by ``dynamic_loss_scaling_policy`` (or ``import_state``).
      state: its ``LossScaleState``.

    Returns:
      A dict of mpx's argument names: 0-d JAX arrays for the arrays, Python numbers for
      ``factor`` and ``period``.

    Raises:
      ValueError: if ``policy`` is not one mpx's ``DynamicLossScaling`` expresses.
      TypeError: if ``state`` is not a ``LossScaleState``.

    Examples:
      >>> from lossscale_jax.compat import mpx
      >>> p = mpx.dynamic_loss_scaling_policy(2.0**15, 1.0, period=100)
      >>> s = mpx.DynamicLossScaling(**mpx.export_state(p, p.adjust(p.init(), False)))
      >>> float(s.loss_scaling), int(s.counter), s.period
      (32768.0, 1, 100)
    """
    scale, count, _ = _host(state)
    if not isinstance(policy, policies.DynamicScale):
        raise ValueError(
            f"policy {policy!r} has no mpx equivalent: export needs a policy built by "
            "compat.mpx.dynamic_loss_scaling_policy."
        )
    factor = float(policy.growth_factor)
    expected = dynamic_loss_scaling_policy(
        policy.min_scale, policy.min_scale, factor, policy.growth_interval
    )
    _require_policy(policy, expected, "mpx", "compat.mpx.dynamic_loss_scaling_policy")
    return {
        "loss_scaling": jnp.asarray(scale, jnp.float32),
        "min_loss_scaling": jnp.asarray(policy.min_scale, jnp.float32),
        "factor": int(factor) if factor.is_integer() else factor,
        "period": int(policy.growth_interval),
        "counter": jnp.asarray(count, jnp.int32),
    }
