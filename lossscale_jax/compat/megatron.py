"""Megatron-LM (``megatron/core/optimizer/grad_scaler.py``).

``DynamicGradScaler``/``ConstantGradScaler`` build the policies;
``import_state``/``export_state`` read and write
``DynamicGradScaler.state_dict()`` (the checkpoint's
``optimizer["grad_scaler"]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _INF,
    _build,
    _clip,
    _field,
    _host,
    _int,
    _number,
    _require_policy,
    _resumed,
    _saved_int,
    _saved_scale,
)
from lossscale_jax.policies import LossScaleState, StaticScale

__all__ = [
    "DynamicGradScaler",
    "ConstantGradScaler",
    "import_state",
    "export_state",
]


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
      initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis:
        as in Megatron (all required there).

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


def import_state(
    state_dict: Mapping[str, Any],
    *,
    min_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
) -> tuple[policies.DynamicScale, LossScaleState]:
    """The policy and state of a ``DynamicGradScaler.state_dict()``.

    Megatron saves the scale and the two trackers; the hyperparameters are
    the run's arguments (``--min-loss-scale``, ``--loss-scale-window``,
    ``--hysteresis``; growth 2 and backoff 0.5 in ``get_megatron_optimizer``).
    Rule::

      policy = DynamicGradScaler(scale, min_scale, growth_factor, backoff_factor,
                                 growth_interval, hysteresis)
      state: growth_count = growth_tracker,
             hysteresis_count = min(hysteresis - hysteresis_tracker, hysteresis)

    A tracker at or below 0 (Megatron keeps decrementing it) means every
    further overflow backs off, as a count of ``hysteresis`` does here.

    Args:
      state_dict: ``{"scale": tensor of shape (1,), "growth_tracker": int,
        "hysteresis_tracker": int}`` (the tensor as ``.cpu().numpy()`` or a
        number).
      min_scale, growth_factor, backoff_factor, growth_interval, hysteresis:
        the ``DynamicGradScaler``'s arguments.

    Returns:
      ``(policy, state)``.

    Raises:
      ValueError: for ``{}`` (a ``ConstantGradScaler`` saves nothing: build
        ``compat.megatron.ConstantGradScaler(initial_scale)``), a missing key
        or a tracker out of range.

    Examples:
      >>> import numpy as np
      >>> from lossscale_jax import compat
      >>> saved = {"scale": np.array([65536.0], np.float32), "growth_tracker": 250,
      ...          "hysteresis_tracker": 1}
      >>> policy, state = compat.megatron.import_state(
      ...     saved, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
      ...     growth_interval=1000, hysteresis=2)
      >>> float(state.scale), int(state.growth_count), int(state.hysteresis_count)
      (65536.0, 250, 1)
    """
    if isinstance(state_dict, Mapping) and len(state_dict) == 0:
        raise ValueError(
            "state_dict is empty: a Megatron ConstantGradScaler saves no state; build "
            "compat.megatron.ConstantGradScaler(initial_scale) instead."
        )
    what = "the Megatron grad scaler state_dict"
    lo = _number("min_scale", min_scale)
    scale = _saved_scale("scale", _field(state_dict, "scale", what))
    policy = DynamicGradScaler(
        _clip(scale, lo, _INF), lo, growth_factor, backoff_factor, growth_interval, hysteresis
    )
    growth = _saved_int(
        "growth_tracker",
        _field(state_dict, "growth_tracker", what),
        0,
        policy.growth_interval - 1,
    )
    tracker = _saved_int(
        "hysteresis_tracker",
        _field(state_dict, "hysteresis_tracker", what),
        -(2**31),
        policy.hysteresis,
    )
    count = min(policy.hysteresis - tracker, policy.hysteresis)
    return policy, _resumed(policy, growth_count=growth, hysteresis_count=count)


def export_state(policy: policies.DynamicScale, state: LossScaleState) -> dict[str, Any]:
    """The ``DynamicGradScaler.state_dict()`` of a policy and state.

    Rule::

      {"scale": float32([scale]), "growth_tracker": growth_count,
       "hysteresis_tracker": hysteresis - hysteresis_count}

    In Megatron: ``grad_scaler.load_state_dict({**d, "scale":
    torch.from_numpy(d["scale"])})``.

    Args:
      policy: built by ``compat.megatron.DynamicGradScaler``.
      state: its ``LossScaleState``.

    Returns:
      A dict of Megatron's keys; ``scale`` a float32 array of shape (1,).

    Raises:
      ValueError: if ``policy`` is not one Megatron's DynamicGradScaler can express.
      TypeError: if ``state`` is not a ``LossScaleState``.

    Examples:
      >>> from lossscale_jax import compat
      >>> p = compat.megatron.DynamicGradScaler(2.0**16, 1.0, 2.0, 0.5, 1000, 2)
      >>> d = compat.megatron.export_state(p, p.adjust(p.init(), True))
      >>> d["scale"].tolist(), d["growth_tracker"], d["hysteresis_tracker"]
      ([65536.0], 0, 1)
    """
    scale, count, hyst = _host(state)
    if not isinstance(policy, policies.DynamicScale):
        raise ValueError(
            f"policy {policy!r} has no Megatron equivalent: export needs a policy built by "
            "compat.megatron.DynamicGradScaler."
        )
    expected = DynamicGradScaler(
        policy.init_scale,
        policy.min_scale,
        policy.growth_factor,
        policy.backoff_factor,
        policy.growth_interval,
        policy.hysteresis,
    )
    _require_policy(policy, expected, "Megatron", "compat.megatron.DynamicGradScaler")
    return {
        "scale": np.asarray([scale], np.float32),
        "growth_tracker": count,
        "hysteresis_tracker": int(policy.hysteresis) - hyst,
    }
