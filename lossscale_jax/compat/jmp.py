"""DeepMind jmp (``jmp/_src/loss_scale.py``, ``jmp/_src/policy.py``).

jmp's public names, with jmp's arguments (positions included) and methods:
``import lossscale_jax.compat.jmp as jmp`` runs a jmp program unchanged, bit for
bit (``DynamicLossScale``, ``StaticLossScale``, ``NoOpLossScale``, ``all_finite``,
``select_tree``, ``get_policy``, ``Policy``, ``cast_to_full``, ``cast_to_half``,
``half_dtype``). The ``*_policy`` constructors build the same rules as policies
for ``lsj.loss_scaling``; ``import_state`` and ``export_state`` convert a
``jmp.DynamicLossScale`` (its fields) to and from a policy and state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _field,
    _has,
    _host,
    _require_policy,
    _saved_array,
)
from lossscale_jax.compat._jmp_policy import (
    Policy,
    cast_to_full,
    cast_to_half,
    get_policy,
    half_dtype,
)
from lossscale_jax.compat._jmp_scale import (
    DynamicLossScale,
    LossScale,  # noqa: F401  (jmp's type alias; not in __all__, which the API pages list)
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    dynamic_loss_scale_policy,
    no_op_loss_scale_policy,
    select_tree,
    static_loss_scale_policy,
)
from lossscale_jax.policies import LossScalePolicy, LossScaleState, StaticScale

__all__ = [
    "DynamicLossScale",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "cast_to_full",
    "cast_to_half",
    "dynamic_loss_scale_policy",
    "export_state",
    "get_policy",
    "half_dtype",
    "import_state",
    "no_op_loss_scale_policy",
    "select_tree",
    "static_loss_scale_policy",
]


def import_state(loss_scale: Any) -> tuple[LossScalePolicy, LossScaleState]:
    """The policy and state of a jmp loss scale (the object, or a dict of its fields).

    Rule::

      DynamicLossScale(loss_scale, counter, period, factor, min_loss_scale)
          -> (compat.jmp.dynamic_loss_scale_policy(same arguments), its init())
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
        policy = no_op_loss_scale_policy()
        return policy, policy.init()
    what = "the jmp loss scale"
    scale = _saved_array("loss_scale", _field(loss_scale, "loss_scale", what))
    if not _has(loss_scale, "counter"):
        policy = static_loss_scale_policy(scale)
        return policy, policy.init()

    def get(key: str, default: Any) -> Any:
        return _field(loss_scale, key, what) if _has(loss_scale, key) else default

    policy = dynamic_loss_scale_policy(
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
      policy: built by ``compat.jmp.dynamic_loss_scale_policy`` (or ``static_loss_scale_policy``).
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
      >>> p = compat.jmp.dynamic_loss_scale_policy(2.0**15, period=100)
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
            "compat.jmp.dynamic_loss_scale_policy."
        )
    factor = float(policy.growth_factor)
    expected = dynamic_loss_scale_policy(
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
    _require_policy(policy, expected, "jmp", "compat.jmp.dynamic_loss_scale_policy")
    return {
        "loss_scale": np.float32(scale),
        "counter": np.int32(count),
        "period": int(policy.growth_interval),
        "factor": int(factor) if factor.is_integer() else factor,
        "min_loss_scale": np.float32(policy.min_scale),
    }
