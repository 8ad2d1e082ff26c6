"""DeepSpeed: the ZeRO scaler and the fp16 optimizers without ZeRO.

DeepSpeed has two dynamic rules. ZeRO (stages 1-3) and ``bf16``/``fp16``
engines built on ``CreateLossScaler`` use ``DynamicLossScaler``
(``deepspeed/runtime/fp16/loss_scaler.py``; hysteresis, a raise at the
minimum scale). The fp16 optimizers used without ZeRO, ``FP16_Optimizer``
(``deepspeed/runtime/fp16/fused_optimizer.py``, chosen for fused Adam) and
``FP16_UnfusedOptimizer`` (``unfused_optimizer.py``, e.g. LAMB), run their
own ``_update_scale``: no hysteresis, a fixed factor 2, and the first growth
after an overflow one step later. ``import_state``/``export_state`` read and
write the ZeRO scaler's attributes; ``import_fp16_optimizer_state`` /
``export_fp16_optimizer_state`` the fp16 optimizers' ``state_dict()``.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _INF,
    _bool,
    _build,
    _clip,
    _field,
    _has,
    _host,
    _int,
    _number,
    _require_policy,
    _resumed,
    _saved_int,
    _saved_scale,
)
from lossscale_jax.compat._deepspeed_fp16 import (
    FP16_Optimizer,
    FP16_UnfusedOptimizer,
    _good_steps,
    export_fp16_optimizer_state,
    fp16_optimizer_policy,
    import_fp16_optimizer_state,
)
from lossscale_jax.policies import LossScalePolicy, LossScaleState, StaticScale

__all__ = [
    "DynamicLossScaler",
    "fp16_optimizer_policy",
    "FP16_Optimizer",
    "FP16_UnfusedOptimizer",
    "import_state",
    "export_state",
    "import_fp16_optimizer_state",
    "export_fp16_optimizer_state",
]


def DynamicLossScaler(
    init_scale: float = 2.0**32,
    scale_factor: float = 2.0,
    scale_window: int = 1000,
    min_scale: float = 1,
    delayed_shift: int = 1,
    consecutive_hysteresis: bool = False,
    raise_error_at_min_scale: bool = True,
) -> policies.DynamicScale:
    """DeepSpeed's dynamic scaler with delayed shift (hysteresis).

    Rule (``DynamicLossScaler.update_scale``)::

      if overflow:
          if delayed_shift == 1 or cur_hysteresis == 1:
              if scale == min_scale and raise_error_at_min_scale: raise
              scale = max(scale / scale_factor, min_scale)
          else:
              cur_hysteresis -= 1
          last_overflow_iter = cur_iter
      else:
          if consecutive_hysteresis: cur_hysteresis = delayed_shift
          if (cur_iter - last_overflow_iter) % scale_window == 0:
              if not consecutive_hysteresis: cur_hysteresis = delayed_shift
              scale *= scale_factor
      cur_iter += 1

    ``cur_hysteresis`` is not restored by a backoff: once it reaches 1
    every overflow backs off until a growth (or, with
    ``consecutive_hysteresis``, a good step) restores it. That is
    ``DynamicScale(hysteresis=delayed_shift, sticky_hysteresis=True)``.

    The raise: under ``jit`` no exception can leave the step. The step
    DeepSpeed raises at is the step with ``metrics(opt_state)["stuck"]``
    True; it is skipped like any overflow and the state stays valid. Pass
    ``on_stuck="error"`` to ``loss_scaling`` to turn it into a ``checkify``
    error (``raise_error_at_min_scale=True``) or leave ``on_stuck="skip"``
    (``False``: DeepSpeed goes on skipping too).

    DeepSpeed keeps the scale in a Python float; here it is float32, so
    trajectories agree exactly for power-of-two ``scale_factor`` (the
    default 2) and the scale is not grown past float32's range.

    Args:
      init_scale, scale_factor, scale_window, min_scale, delayed_shift, consecutive_hysteresis:
        as in DeepSpeed.
      raise_error_at_min_scale: see above: it chooses the ``on_stuck`` to
        pass to ``loss_scaling`` (``"error"`` for True); the policy reports
        ``stuck`` either way.

    Returns:
      A ``DynamicScale``.

    Examples:
      >>> from lossscale_jax import compat
      >>> p = compat.deepspeed.DynamicLossScaler(delayed_shift=2)
      >>> p.hysteresis, p.sticky_hysteresis
      (2, True)
    """
    _bool("raise_error_at_min_scale", raise_error_at_min_scale)
    factor = _number("scale_factor", scale_factor)
    if not factor > 1.0:
        raise ValueError(f"scale_factor must be > 1, got {scale_factor!r}.")
    names = {
        "growth_interval": "scale_window",
        "hysteresis": "delayed_shift",
        "growth_factor": "scale_factor",
    }
    return _build(
        policies.DynamicScale,
        names,
        init_scale=_number("init_scale", init_scale),
        growth_factor=factor,
        backoff_factor=1.0 / factor,
        growth_interval=_int("scale_window", scale_window),
        hysteresis=_int("delayed_shift", delayed_shift),
        consecutive_hysteresis=_bool("consecutive_hysteresis", consecutive_hysteresis),
        min_scale=_number("min_scale", min_scale),
        max_scale=_INF,
        sticky_hysteresis=True,
    )


# --------------------------------------------------------------------------
# The fp16 optimizers without ZeRO.


def import_state(loss_scaler: Any) -> tuple[LossScalePolicy, LossScaleState]:
    """The policy and state of a saved ``DynamicLossScaler`` (or static ``LossScaler``).

    ZeRO optimizers save the scaler object itself (``state_dict()["loss_scaler"]``
    in ``*_optim_states.pt``); pass its attributes, ``vars(loss_scaler)``, as
    a dict (or the object). Rule::

      n = cur_iter - last_overflow_iter - 1        # good steps since the last overflow
      policy = DynamicLossScaler(cur_scale, scale_factor, scale_window, min_scale,
                                 delayed_shift, consecutive_hysteresis)
      state: growth_count = n % scale_window,
             hysteresis_count = delayed_shift - cur_hysteresis
      static LossScaler (dynamic False): StaticScale(cur_scale)

    Args:
      loss_scaler: ``vars(loss_scaler)`` (``cur_scale``, ``cur_iter``,
        ``last_overflow_iter``, ``scale_factor``, ``scale_window``,
        ``min_scale``, ``delayed_shift``, ``cur_hysteresis``,
        ``consecutive_hysteresis``, ``dynamic``; others are ignored), or
        ``{"cur_scale": s, "dynamic": False}`` for a static scaler.

    Returns:
      ``(policy, state)``. The raise at the minimum scale is not part of the
      policy: pass ``on_stuck="error"`` to ``loss_scaling`` when the saved
      ``raise_error_at_min_scale`` is True.

    Raises:
      ValueError: for a missing entry, a saved scale that is not finite and > 0, or a
        counter outside the original's range. TypeError: for a value that is not a number.

    Examples:
      >>> from lossscale_jax import compat
      >>> saved = {"cur_scale": 2.0**16, "cur_iter": 120, "last_overflow_iter": 99,
      ...          "scale_factor": 2.0, "scale_window": 1000, "min_scale": 1,
      ...          "delayed_shift": 2, "cur_hysteresis": 1, "consecutive_hysteresis": False,
      ...          "raise_error_at_min_scale": True, "dynamic": True}
      >>> policy, state = compat.deepspeed.import_state(saved)
      >>> int(state.growth_count), int(state.hysteresis_count)
      (20, 1)
    """
    what = "the DeepSpeed loss scaler"
    scale = _saved_scale("cur_scale", _field(loss_scaler, "cur_scale", what))
    dynamic = _field(loss_scaler, "dynamic", what) if _has(loss_scaler, "dynamic") else True
    if not _bool("dynamic", dynamic):
        policy = StaticScale(scale)
        return policy, policy.init()
    window = _saved_int("scale_window", _field(loss_scaler, "scale_window", what), 1)
    shift = _saved_int("delayed_shift", _field(loss_scaler, "delayed_shift", what), 1)
    lo = _number("min_scale", _field(loss_scaler, "min_scale", what))
    policy = DynamicLossScaler(
        init_scale=_clip(scale, lo, _INF),
        scale_factor=_number("scale_factor", _field(loss_scaler, "scale_factor", what)),
        scale_window=window,
        min_scale=lo,
        delayed_shift=shift,
        consecutive_hysteresis=_bool(
            "consecutive_hysteresis", _field(loss_scaler, "consecutive_hysteresis", what)
        ),
    )
    n = _good_steps(
        _saved_int("cur_iter", _field(loss_scaler, "cur_iter", what), 0),
        _saved_int("last_overflow_iter", _field(loss_scaler, "last_overflow_iter", what), -1),
    )
    hyst = _saved_int("cur_hysteresis", _field(loss_scaler, "cur_hysteresis", what), 1, shift)
    return policy, _resumed(policy, growth_count=n % window, hysteresis_count=shift - hyst)


def export_state(
    policy: LossScalePolicy, state: LossScaleState, *, raise_error_at_min_scale: bool = True
) -> dict[str, Any]:
    """A ``DynamicLossScaler``'s attributes for a policy and state, to continue in DeepSpeed.

    Rule (the inverse of ``import_state``; ``cur_iter`` counts the steps this
    state ran, DeepSpeed reads it only relative to ``last_overflow_iter``)::

      cur_iter = max(total_steps, growth_count)
      last_overflow_iter = cur_iter - 1 - growth_count
      cur_hysteresis = max(delayed_shift - hysteresis_count, 1)

    In DeepSpeed: ``optimizer.loss_scaler.__dict__.update(d)`` (ZeRO).

    Args:
      policy: built by ``compat.deepspeed.DynamicLossScaler`` (or a
        ``StaticScale`` for a static ``LossScaler``).
      state: its ``LossScaleState``.
      raise_error_at_min_scale: the value to save (the policy does not hold it).

    Returns:
      A dict of DeepSpeed's attribute names (Python numbers and bools).

    Raises:
      ValueError: if ``policy`` is not one DeepSpeed's DynamicLossScaler can express.
      TypeError: if ``state`` is not a ``LossScaleState``.

    Examples:
      >>> from lossscale_jax import compat
      >>> p = compat.deepspeed.DynamicLossScaler(init_scale=2.0**16, delayed_shift=2)
      >>> d = compat.deepspeed.export_state(p, p.adjust(p.init(), True))
      >>> d["cur_scale"], d["cur_hysteresis"], d["last_overflow_iter"]
      (65536.0, 1, 0)
    """
    scale, count, hyst = _host(state)
    total = int(jnp.asarray(state.total_steps))
    if isinstance(policy, StaticScale) and policy.skip_on_overflow:
        return {"cur_scale": scale, "dynamic": False}
    if not isinstance(policy, policies.DynamicScale):
        raise ValueError(
            f"policy {policy!r} has no DeepSpeed equivalent: export needs a policy built by "
            "compat.deepspeed.DynamicLossScaler."
        )
    factor = float(policy.growth_factor)
    expected = DynamicLossScaler(
        init_scale=policy.init_scale,
        scale_factor=factor,
        scale_window=policy.growth_interval,
        min_scale=policy.min_scale,
        delayed_shift=policy.hysteresis,
        consecutive_hysteresis=policy.consecutive_hysteresis,
    )
    _require_policy(policy, expected, "DeepSpeed", "compat.deepspeed.DynamicLossScaler")
    cur_iter = max(total, count)
    return {
        "cur_scale": scale,
        "cur_iter": cur_iter,
        "last_overflow_iter": cur_iter - 1 - count,
        "scale_factor": factor,
        "scale_window": int(policy.growth_interval),
        "min_scale": float(policy.min_scale),
        "delayed_shift": int(policy.hysteresis),
        "cur_hysteresis": max(int(policy.hysteresis) - hyst, 1),
        "consecutive_hysteresis": bool(policy.consecutive_hysteresis),
        "raise_error_at_min_scale": _bool("raise_error_at_min_scale", raise_error_at_min_scale),
        "dynamic": True,
    }
