"""Colossal-AI (``colossalai/amp/naive_amp/grad_scaler/dynamic_grad_scaler.py``).

``DynamicGradScaler`` builds the policy; ``import_state``/``export_state`` read and
write ``DynamicGradScaler.state_dict()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _INF,
    _TINY,
    _bool,
    _build,
    _field,
    _host,
    _int,
    _number,
    _require_policy,
    _resumed,
    _saved_int,
    _saved_scale,
)
from lossscale_jax.policies import LossScaleState

__all__ = ["DynamicGradScaler", "import_state", "export_state"]


def _bound(name: str, value: float | None) -> float | None:
    """``None`` for ``None`` and for 0, as Colossal-AI's ``if min_scale:`` reads them."""
    if value is None:
        return None
    number = _number(name, value)
    return None if number == 0.0 else number


def DynamicGradScaler(
    initial_scale: float = 2**16,
    growth_factor: float = 2,
    backoff_factor: float = 0.5,
    growth_interval: int = 1000,
    min_scale: float | None = None,
    max_scale: float | None = None,
    hysteresis: int = 2,
    verbose: bool = False,
) -> policies.DynamicScale:
    """Colossal-AI's dynamic scaler; its hysteresis count is reset only by a growth.

    Rule (``DynamicGradScaler.update``, float32 tensors)::

      if overflow:
          hysteresis_step += 1; growth_step = 0
          if hysteresis_step >= hysteresis:
              scale = scale * backoff_factor
              if min_scale: scale = max(scale, min_scale)
      else:
          growth_step += 1
          if growth_step == growth_interval:
              growth_step = hysteresis_step = 0
              scale = scale * growth_factor
              if max_scale: scale = min(scale, max_scale)

    That is ``DynamicScale(consecutive_hysteresis=False,
    sticky_hysteresis=True)``, as Megatron-LM's scaler: after ``hysteresis``
    overflows every further one backs off until a growth. ``hysteresis=0``
    backs off on every overflow, as ``hysteresis=1`` does (it is stored as
    1). ``min_scale``/``max_scale`` of ``None`` or 0 mean no bound, as
    Colossal-AI reads them; without a floor the scale stops at ``2**-126``
    here, and without a cap a growth whose float32 result is not finite is
    refused (Colossal-AI would store ``inf``; with a cap it stores the cap,
    as here).

    Args:
      initial_scale, growth_factor, backoff_factor, growth_interval: as in Colossal-AI.
      min_scale, max_scale, hysteresis: as in Colossal-AI (see above for None, 0).
      verbose: Colossal-AI's logging switch; checked, and has no effect here
        (read ``lsj.metrics``).

    Returns:
      A ``DynamicScale``.

    Raises:
      ValueError: where Colossal-AI's ``_sanity_checks`` assert (``min_scale``
        above ``initial_scale``, ``growth_factor <= 1``, ...).

    Examples:
      >>> from lossscale_jax import compat
      >>> p = compat.colossalai.DynamicGradScaler()
      >>> p.hysteresis, p.sticky_hysteresis, p.consecutive_hysteresis, p.min_scale
      (2, True, False, 1.1754943508222875e-38)
    """
    _bool("verbose", verbose)
    init = _number("initial_scale", initial_scale)
    if not init > 0.0:
        raise ValueError(f"initial_scale must be > 0, got {initial_scale!r}.")
    lo, hi = _bound("min_scale", min_scale), _bound("max_scale", max_scale)
    if lo is not None and not 0.0 < lo <= init:
        raise ValueError(
            f"min_scale must be > 0 and <= initial_scale ({initial_scale!r}), got {min_scale!r}."
        )
    if hi is not None and not (hi > 0.0 and hi >= init):
        raise ValueError(
            f"max_scale must be > 0 and >= initial_scale ({initial_scale!r}), got {max_scale!r}."
        )
    hyst = _int("hysteresis", hysteresis)
    if hyst < 0:
        raise ValueError(f"hysteresis must be >= 0, got {hysteresis!r}.")
    return _build(
        policies.DynamicScale,
        {"init_scale": "initial_scale"},
        init_scale=init,
        growth_factor=_number("growth_factor", growth_factor),
        backoff_factor=_number("backoff_factor", backoff_factor),
        growth_interval=_int("growth_interval", growth_interval),
        hysteresis=max(hyst, 1),
        consecutive_hysteresis=False,
        min_scale=_TINY if lo is None else lo,
        max_scale=_INF if hi is None else hi,
        sticky_hysteresis=True,
        growth_overflow="refuse" if hi is None else "clamp",
    )


def import_state(
    state_dict: Mapping[str, Any],
    *,
    growth_interval: int = 1000,
    min_scale: float | None = None,
    max_scale: float | None = None,
) -> tuple[policies.DynamicScale, LossScaleState]:
    """The policy and state of a ``DynamicGradScaler.state_dict()``.

    Colossal-AI saves the scale, ``growth_factor``, ``backoff_factor`` and
    ``hysteresis``, and its ``load_state_dict`` sets those four; the step
    counters are not saved and keep their values (zero in a fresh scaler).
    Rule::

      policy = DynamicGradScaler(scale, growth_factor, backoff_factor, growth_interval,
                                 min_scale, max_scale, hysteresis)
      state = policy.init()

    ``min_scale`` and ``max_scale`` are widened to take in a saved scale
    outside them (Colossal-AI checks them only at construction).

    Args:
      state_dict: ``{"scale": tensor of shape (1,), "growth_factor",
        "backoff_factor", "hysteresis"}`` (the tensor as ``.cpu().numpy()``
        or a number).
      growth_interval, min_scale, max_scale: the scaler's arguments.

    Returns:
      ``(policy, state)``.

    Examples:
      >>> import numpy as np
      >>> from lossscale_jax import compat
      >>> saved = {"scale": np.array([1024.0], np.float32), "growth_factor": 2,
      ...          "backoff_factor": 0.5, "hysteresis": 2}
      >>> policy, state = compat.colossalai.import_state(saved)
      >>> float(state.scale), policy.hysteresis
      (1024.0, 2)
    """
    what = "the Colossal-AI DynamicGradScaler state_dict"
    scale = _saved_scale("scale", _field(state_dict, "scale", what))
    hyst = _saved_int("hysteresis", _field(state_dict, "hysteresis", what), 0)
    lo, hi = _bound("min_scale", min_scale), _bound("max_scale", max_scale)
    policy = DynamicGradScaler(
        scale,
        _number("growth_factor", _field(state_dict, "growth_factor", what)),
        _number("backoff_factor", _field(state_dict, "backoff_factor", what)),
        growth_interval,
        None if lo is None else min(lo, scale),
        None if hi is None else max(hi, scale),
        hyst,
    )
    return policy, _resumed(policy)


def export_state(policy: policies.DynamicScale, state: LossScaleState) -> dict[str, Any]:
    """The ``DynamicGradScaler.state_dict()`` of a policy and state.

    Rule::

      {"scale": float32([scale]), "growth_factor": growth_factor,
       "backoff_factor": backoff_factor, "hysteresis": hysteresis}

    Colossal-AI does not save its step counters, so a run resumed there
    restarts them. In Colossal-AI: ``scaler.load_state_dict({**d, "scale":
    torch.from_numpy(d["scale"]).cuda()})``.

    Args:
      policy: built by ``compat.colossalai.DynamicGradScaler``.
      state: its ``LossScaleState``.

    Returns:
      A dict of Colossal-AI's keys; ``scale`` a float32 array of shape (1,).

    Raises:
      ValueError: if ``policy`` is not one Colossal-AI's scaler can express.
      TypeError: if ``state`` is not a ``LossScaleState``.

    Examples:
      >>> from lossscale_jax import compat
      >>> p = compat.colossalai.DynamicGradScaler(initial_scale=256.0, hysteresis=1)
      >>> d = compat.colossalai.export_state(p, p.adjust(p.init(), True))
      >>> d["scale"].tolist(), d["hysteresis"]
      ([128.0], 1)
    """
    scale, _, _ = _host(state)
    if not isinstance(policy, policies.DynamicScale):
        raise ValueError(
            f"policy {policy!r} has no Colossal-AI equivalent: export needs a policy built by "
            "compat.colossalai.DynamicGradScaler."
        )
    expected = DynamicGradScaler(
        policy.init_scale,
        policy.growth_factor,
        policy.backoff_factor,
        policy.growth_interval,
        None if policy.min_scale == _TINY else policy.min_scale,
        None if policy.max_scale == _INF else policy.max_scale,
        policy.hysteresis,
    )
    _require_policy(policy, expected, "Colossal-AI", "compat.colossalai.DynamicGradScaler")
    return {
        "scale": np.asarray([scale], np.float32),
        "growth_factor": policy.growth_factor,
        "backoff_factor": policy.backoff_factor,
        "hysteresis": policy.hysteresis,
    }
