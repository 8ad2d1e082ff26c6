"""DeepSpeed (``deepspeed/runtime/fp16/loss_scaler.py``, ``DynamicLossScaler``)."""

from __future__ import annotations

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _INF,
    _bool,
    _build,
    _int,
    _number,
)


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
      init_scale, scale_factor, scale_window, min_scale, delayed_shift,
      consecutive_hysteresis: as in DeepSpeed.
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
