"""Flax (``flax/training/dynamic_scale.py``).

``DynamicScale`` is the Flax-shaped object (a pytree with ``value_and_grad``):
Flax code runs with it in place of Flax's, bit for bit. ``dynamic_scale_policy``
is the same rule as a policy, for ``lsj.loss_scaling``. ``import_state``/
``export_state`` convert a ``flax.training.dynamic_scale.DynamicScale`` (or its
checkpointed fields) to and from a policy and state.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _F32_MAX,
    _TINY,
    _clip,
    _field,
    _has,
    _host,
    _number,
    _require_policy,
    _resumed,
    _saved_array,
    _saved_int,
    _saved_scale,
)
from lossscale_jax.compat._flax_scale import (
    DynamicScale,
    DynamicScaleResult,
    dynamic_scale_policy,
)
from lossscale_jax.policies import LossScaleState

__all__ = [
    "DynamicScale",
    "DynamicScaleResult",
    "dynamic_scale_policy",
    "import_state",
    "export_state",
]


_FLAX_DEFAULTS = {
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "minimum_scale": _TINY,
}


def import_state(dynamic_scale: Any) -> tuple[policies.DynamicScale, LossScaleState]:
    """The policy and state of a Flax ``DynamicScale`` (the object, or its fields as a dict).

    Rule::

      policy = compat.flax.dynamic_scale_policy(growth_factor, backoff_factor,
                                                growth_interval, scale, minimum_scale)
      state: growth_count = fin_steps

    Flax checkpoints hold only the array fields (``flax.serialization``
    writes ``{"fin_steps", "scale"}``); the hyperparameters are those the
    ``DynamicScale`` was built with (Flax's defaults when a dict lacks them).

    Args:
      dynamic_scale: a ``flax.training.dynamic_scale.DynamicScale``, or a dict
        with ``fin_steps`` and ``scale`` and optionally ``growth_factor``,
        ``backoff_factor``, ``growth_interval``, ``minimum_scale``.

    Returns:
      ``(policy, state)``.

    Raises:
      ValueError: for a missing entry, a saved scale that is not finite and > 0, or a
        counter outside the original's range. TypeError: for a value that is not a number.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax.training.dynamic_scale import DynamicScale
      >>> from lossscale_jax import compat
      >>> ds = DynamicScale(growth_interval=10, fin_steps=jnp.int32(4), scale=jnp.float32(256.0))
      >>> policy, state = compat.flax.import_state(ds)
      >>> float(state.scale), int(state.growth_count), policy.growth_interval
      (256.0, 4, 11)
    """
    what = "the Flax DynamicScale"

    def get(key: str) -> Any:
        if _has(dynamic_scale, key):
            return _field(dynamic_scale, key, what)
        return _FLAX_DEFAULTS[key]

    interval = _saved_int("growth_interval", get("growth_interval"), 0)
    lo = get("minimum_scale")
    lo = None if lo is None else _number("minimum_scale", _saved_array("minimum_scale", lo))
    scale = _saved_scale("scale", _field(dynamic_scale, "scale", what))
    policy = dynamic_scale_policy(
        growth_factor=_number("growth_factor", get("growth_factor")),
        backoff_factor=_number("backoff_factor", get("backoff_factor")),
        growth_interval=interval,
        scale=_clip(scale, _TINY if lo is None else lo, _F32_MAX),
        minimum_scale=lo,
    )
    fin = _saved_int("fin_steps", _field(dynamic_scale, "fin_steps", what), 0, interval)
    return policy, _resumed(policy, growth_count=fin)


def export_state(policy: policies.DynamicScale, state: LossScaleState) -> dict[str, Any]:
    """The fields of a Flax ``DynamicScale`` for a policy and state.

    Rule::

      {"growth_factor", "backoff_factor", "growth_interval": policy.growth_interval - 1,
       "fin_steps": int32(growth_count), "scale": float32(scale),
       "minimum_scale": float32(min_scale)}

    ``flax.training.dynamic_scale.DynamicScale(**d)`` continues the run in
    Flax (put it in the ``TrainState``'s ``dynamic_scale``).

    Args:
      policy: built by ``compat.flax.dynamic_scale_policy`` (or ``import_state``).
      state: its ``LossScaleState``.

    Returns:
      A dict of Flax's field names (NumPy 0-d arrays for the array fields).

    Raises:
      ValueError: if ``policy`` is not one Flax's DynamicScale can express.
      TypeError: if ``state`` is not a ``LossScaleState``.

    Examples:
      >>> from flax.training.dynamic_scale import DynamicScale as FlaxDynamicScale
      >>> from lossscale_jax import compat
      >>> p = compat.flax.dynamic_scale_policy(growth_interval=10, scale=256.0)
      >>> ds = FlaxDynamicScale(**compat.flax.export_state(p, p.init()))
      >>> ds.growth_interval, float(ds.scale), int(ds.fin_steps)
      (10, 256.0, 0)
    """
    scale, count, _ = _host(state)
    if not isinstance(policy, policies.DynamicScale):
        raise ValueError(
            f"policy {policy!r} has no Flax equivalent: export needs a policy built by "
            "compat.flax.dynamic_scale_policy."
        )
    expected = dynamic_scale_policy(
        growth_factor=policy.growth_factor,
        backoff_factor=policy.backoff_factor,
        growth_interval=policy.growth_interval - 1,
        scale=policy.init_scale,
        minimum_scale=policy.min_scale,
    )
    _require_policy(policy, expected, "Flax", "compat.flax.dynamic_scale_policy")
    return {
        "growth_factor": float(policy.growth_factor),
        "backoff_factor": float(policy.backoff_factor),
        "growth_interval": int(policy.growth_interval) - 1,
        "fin_steps": np.int32(count),
        "scale": np.float32(scale),
        "minimum_scale": np.float32(policy.min_scale),
    }
