"""PaddlePaddle (``python/paddle/amp/grad_scaler.py``, the ``update_loss_scaling`` op).

``GradScaler`` builds the policy of the dynamic-graph ``paddle.amp.GradScaler``;
``import_state``/``export_state`` read and write its ``state_dict()``.
``update_loss_scaling`` is the static-graph op's rule
(``paddle/phi/kernels/impl/amp_kernel_impl.h``, ``Update``), which
``paddle.static.amp.decorate`` runs: the same counters, a backoff floored at 1.
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
from lossscale_jax.policies import LossScalePolicy, LossScaleState, NoScale, StaticScale

__all__ = ["GradScaler", "update_loss_scaling", "import_state", "export_state"]

_NAMES = {
    "init_scale": "init_loss_scaling",
    "growth_factor": "incr_ratio",
    "backoff_factor": "decr_ratio",
    "growth_interval": "incr_every_n_steps",
    "hysteresis": "decr_every_n_nan_or_inf",
}

_STATE_DICT_KEYS = (
    "scale",
    "incr_ratio",
    "decr_ratio",
    "incr_every_n_steps",
    "decr_every_n_nan_or_inf",
    "incr_count",
    "decr_count",
    "use_dynamic_loss_scaling",
)


def _counting_rule(
    init_loss_scaling: Any,
    incr_ratio: Any,
    decr_ratio: Any,
    incr_every_n_steps: Any,
    decr_every_n_nan_or_inf: Any,
    min_scale: float,
) -> policies.DynamicScale:
    """Paddle's two counters as ``DynamicScale``: both count steps in a row."""
    incr = _number("incr_ratio", incr_ratio)
    decr = _number("decr_ratio", decr_ratio)
    if not incr > 1.0:
        raise ValueError(f"The incr_ratio must be > 1.0, got incr_ratio={incr_ratio!r}.")
    if not decr < 1.0:
        raise ValueError(f"The decr_ratio must be < 1.0, got decr_ratio={decr_ratio!r}.")
    return _build(
        policies.DynamicScale,
        _NAMES,
        init_scale=_number("init_loss_scaling", init_loss_scaling),
        growth_factor=incr,
        backoff_factor=decr,
        growth_interval=_int("incr_every_n_steps", incr_every_n_steps),
        hysteresis=_int("decr_every_n_nan_or_inf", decr_every_n_nan_or_inf),
        consecutive_hysteresis=True,
        min_scale=min_scale,
        max_scale=_INF,
    )


def GradScaler(
    enable: bool = True,
    init_loss_scaling: float = 2.0**16,
    incr_ratio: float = 2.0,
    decr_ratio: float = 0.5,
    incr_every_n_steps: int = 2000,
    decr_every_n_nan_or_inf: int = 1,
    use_dynamic_loss_scaling: bool = True,
) -> LossScalePolicy:
    """``paddle.amp.GradScaler``: grow after n good steps in a row, back off after m bad ones.

    Rule (``AmpScaler._update`` in ``python/paddle/amp/grad_scaler.py``; the
    scale a float32 tensor, multiplied by the ratio in float32)::

      if found_inf:                                 # the optimizer step is skipped
          incr_count = 0
          decr_count += 1
          if decr_count == decr_every_n_nan_or_inf:
              scale = scale * decr_ratio; decr_count = 0
      else:
          decr_count = 0
          incr_count += 1
          if incr_count == incr_every_n_steps:
              scale = scale * incr_ratio; incr_count = 0

    This is ``DynamicScale(hysteresis=decr_every_n_nan_or_inf,
    consecutive_hysteresis=True, min_scale=2**-126, max_scale=inf)``. Paddle
    has no floor and stores ``inf`` after a growth past float32's largest
    number; here the scale stops at ``2**-126`` and a growth to ``inf`` is
    refused. The defaults are those of current Paddle; older releases
    defaulted to ``init_loss_scaling=2**15, incr_every_n_steps=1000,
    decr_every_n_nan_or_inf=2`` (pass them to reproduce such a run).

    ``use_dynamic_loss_scaling=False`` gives ``StaticScale(init_loss_scaling)``
    (Paddle still skips an overflowing step); ``enable=False`` gives
    ``NoScale()`` (Paddle then steps the optimizer unchecked).

    Args:
      enable: scale at all (False: ``NoScale()``).
      init_loss_scaling: the starting scale, finite and > 0.
      incr_ratio: > 1. decr_ratio: in (0, 1).
      incr_every_n_steps: good steps in a row before a growth (int >= 1;
        Paddle's ``==`` never fires for 0).
      decr_every_n_nan_or_inf: overflows in a row before a backoff (int >= 1).
      use_dynamic_loss_scaling: False gives ``StaticScale(init_loss_scaling)``.

    Returns:
      A ``DynamicScale``, ``StaticScale`` or ``NoScale``.

    Raises:
      ValueError: ``incr_ratio <= 1`` or ``decr_ratio >= 1`` (Paddle's
        asserts), a count below 1, a scale that is not finite and > 0.
      TypeError: an argument of the wrong type.

    Examples:
      >>> from lossscale_jax import compat
      >>> p = compat.paddle.GradScaler(init_loss_scaling=1024, decr_every_n_nan_or_inf=2)
      >>> s = p.adjust(p.init(), True)              # one overflow: counted
      >>> float(s.scale), int(s.hysteresis_count)
      (1024.0, 1)
      >>> float(p.adjust(s, True).scale)            # two in a row: back off
      512.0
    """
    if not _bool("enable", enable):
        return NoScale()
    if not _bool("use_dynamic_loss_scaling", use_dynamic_loss_scaling):
        return _build(
            StaticScale,
            {"scale": "init_loss_scaling"},
            scale=_number("init_loss_scaling", init_loss_scaling),
        )
    return _counting_rule(
        init_loss_scaling,
        incr_ratio,
        decr_ratio,
        incr_every_n_steps,
        decr_every_n_nan_or_inf,
        _TINY,
    )


def update_loss_scaling(
    init_loss_scaling: float = 2.0**16,
    incr_every_n_steps: int = 2000,
    decr_every_n_nan_or_inf: int = 1,
    incr_ratio: float = 2.0,
    decr_ratio: float = 0.5,
) -> LossScalePolicy:
    """The static-graph ``update_loss_scaling`` op: GradScaler's counters, backoff floored at 1.

    Rule (``Update`` in ``paddle/phi/kernels/impl/amp_kernel_impl.h``; the
    scale float32 for float16, bfloat16 and float32 gradients)::

      if found_inf:                                 # the gradients are zeroed: skipped
          good_steps = 0
          bad_steps += 1
          if bad_steps == decr_every_n_nan_or_inf:
              scale = max(scale * decr_ratio, 1); bad_steps = 0
      else:
          bad_steps = 0
          good_steps += 1
          if good_steps == incr_every_n_steps:
              if isfinite(scale * incr_ratio): scale = scale * incr_ratio
              good_steps = 0

    This is ``DynamicScale(hysteresis=decr_every_n_nan_or_inf,
    consecutive_hysteresis=True, min_scale=1, max_scale=inf)``. The defaults
    are those of ``paddle.static.amp.decorate`` (the op's attributes have
    none); the fp16-only ``decorate`` overload (``use_pure_fp16=``,
    ``use_bf16=``) defaults to ``init_loss_scaling=2**15,
    incr_every_n_steps=1000, decr_every_n_nan_or_inf=2, decr_ratio=0.8``.
    ``init_loss_scaling`` must be >= 1: below it the op would raise the scale
    to 1 at its first backoff. ``stuck`` is set by an overflow at scale 1.

    Args:
      init_loss_scaling: the starting scale, >= 1.
      incr_every_n_steps, decr_every_n_nan_or_inf: ints >= 1.
      incr_ratio: > 1. decr_ratio: in (0, 1).

    Returns:
      A ``DynamicScale``.

    Examples:
      >>> from lossscale_jax import compat
      >>> p = compat.paddle.update_loss_scaling(init_loss_scaling=1.5, decr_ratio=0.5)
      >>> float(p.adjust(p.init(), True).scale)     # 0.75 floored at 1
      1.0
    """
    init = _number("init_loss_scaling", init_loss_scaling)
    if not init >= 1.0:
        raise ValueError(
            f"init_loss_scaling must be >= 1 for update_loss_scaling (the op floors a backoff "
            f"at 1, raising a smaller scale to 1), got {init_loss_scaling!r}."
        )
    return _counting_rule(
        init, incr_ratio, decr_ratio, incr_every_n_steps, decr_every_n_nan_or_inf, 1.0
    )


def import_state(state_dict: Mapping[str, Any]) -> tuple[LossScalePolicy, LossScaleState]:
    """The policy and state of a ``paddle.amp.GradScaler.state_dict()``.

    Rule (``AmpScaler.load_state_dict``: everything comes with the dict)::

      if not use_dynamic_loss_scaling: policy = GradScaler(init_loss_scaling=scale[0],
                                                           use_dynamic_loss_scaling=False)
      else: policy = GradScaler(init_loss_scaling=scale[0], incr_ratio=..., decr_ratio=...,
                                incr_every_n_steps=..., decr_every_n_nan_or_inf=...)
      state = policy.init() with growth_count = incr_count, hysteresis_count = decr_count

    Args:
      state_dict: ``scaler.state_dict()``: ``scale`` (a float32 array of
        shape (1,)), ``incr_ratio``, ``decr_ratio``, ``incr_every_n_steps``,
        ``decr_every_n_nan_or_inf``, ``incr_count``, ``decr_count``,
        ``use_dynamic_loss_scaling``.

    Returns:
      ``(policy, state)``.

    Raises:
      ValueError: an empty dict (Paddle's disabled scaler saves ``{}``), a
        missing key, a scale not finite and > 0, or a count outside
        ``[0, n)`` of its ``n`` (Paddle's ``==`` would never fire again).
      TypeError: a value of the wrong type.

    Examples:
      >>> import numpy as np
      >>> from lossscale_jax import compat
      >>> policy, state = compat.paddle.import_state({
      ...     "scale": np.array([1024.0], np.float32), "incr_ratio": 2.0, "decr_ratio": 0.5,
      ...     "incr_every_n_steps": 1000, "decr_every_n_nan_or_inf": 2,
      ...     "incr_count": 7, "decr_count": 1, "use_dynamic_loss_scaling": True})
      >>> float(state.scale), int(state.growth_count), int(state.hysteresis_count)
      (1024.0, 7, 1)
    """
    if isinstance(state_dict, Mapping) and len(state_dict) == 0:
        raise ValueError(
            "The input state dict is empty, possibly because it was saved from a disabled "
            "instance of GradScaler (use compat.paddle.GradScaler(enable=False), which has no "
            "state)."
        )
    what = "the GradScaler state_dict"
    scale = _saved_scale("scale", _field(state_dict, "scale", what))
    dynamic = _bool(
        "use_dynamic_loss_scaling", _field(state_dict, "use_dynamic_loss_scaling", what)
    )
    if not dynamic:
        policy = GradScaler(init_loss_scaling=scale, use_dynamic_loss_scaling=False)
        return policy, policy.init()
    incr_n = _saved_int("incr_every_n_steps", _field(state_dict, "incr_every_n_steps", what), 1)
    decr_n = _saved_int(
        "decr_every_n_nan_or_inf", _field(state_dict, "decr_every_n_nan_or_inf", what), 1
    )
    policy = GradScaler(
        init_loss_scaling=_clip(scale, _TINY, _INF),
        incr_ratio=_number("incr_ratio", _field(state_dict, "incr_ratio", what)),
        decr_ratio=_number("decr_ratio", _field(state_dict, "decr_ratio", what)),
        incr_every_n_steps=incr_n,
        decr_every_n_nan_or_inf=decr_n,
    )
    incr = _saved_int("incr_count", _field(state_dict, "incr_count", what), 0, incr_n - 1)
    decr = _saved_int("decr_count", _field(state_dict, "decr_count", what), 0, decr_n - 1)
    return policy, _resumed(policy, growth_count=incr, hysteresis_count=decr)


def export_state(policy: LossScalePolicy, state: LossScaleState) -> dict[str, Any]:
    """The ``GradScaler.state_dict()`` of a policy and state, for ``load_state_dict``.

    Rule::

      {"scale": np.array([state.scale], float32), "incr_ratio": ..., "decr_ratio": ...,
       "incr_every_n_steps": ..., "decr_every_n_nan_or_inf": ...,
       "incr_count": state.growth_count, "decr_count": state.hysteresis_count,
       "use_dynamic_loss_scaling": True}
      StaticScale(s) -> the same with use_dynamic_loss_scaling False, counts 0 and
                        GradScaler's default ratios and counts (unused by Paddle then)
      NoScale() -> {}                               # a disabled scaler's state_dict

    Reads the state on the host (call it outside ``jit``).

    Args:
      policy: built by ``compat.paddle.GradScaler`` (or ``import_state``).
      state: its ``LossScaleState``.

    Returns:
      A dict of Paddle's keys.

    Raises:
      ValueError: if ``policy`` is not one ``GradScaler`` builds (the op's
        rule, with its floor at 1, has no ``state_dict``).
      TypeError: if ``state`` is not a ``LossScaleState``.

    Examples:
      >>> from lossscale_jax import compat
      >>> p = compat.paddle.GradScaler(init_loss_scaling=8.0, incr_every_n_steps=3)
      >>> d = compat.paddle.export_state(p, p.adjust(p.init(), False))
      >>> d["scale"], d["incr_count"], d["decr_count"]
      (array([8.], dtype=float32), 1, 0)
    """
    if isinstance(policy, NoScale) and not policy.skip_on_overflow:
        _host(state)
        return {}
    if isinstance(policy, StaticScale) and policy.skip_on_overflow:
        scale, _, _ = _host(state)
        values = (2.0, 0.5, 2000, 1, 0, 0, False)  # GradScaler's defaults: unused when static
    else:
        if not isinstance(policy, policies.DynamicScale):
            raise ValueError(
                f"policy {policy!r} has no Paddle GradScaler equivalent: export needs a policy "
                "built by compat.paddle.GradScaler."
            )
        expected = _counting_rule(
            policy.init_scale,
            policy.growth_factor,
            policy.backoff_factor,
            policy.growth_interval,
            policy.hysteresis,
            _TINY,
        )
        _require_policy(policy, expected, "Paddle GradScaler", "compat.paddle.GradScaler")
        scale, incr, decr = _host(state)
        values = (
            policy.growth_factor,
            policy.backoff_factor,
            policy.growth_interval,
            policy.hysteresis,
            incr,
            decr,
            True,
        )
    incr_ratio, decr_ratio, incr_n, decr_n, incr, decr, dynamic = values
    return dict(
        zip(
            _STATE_DICT_KEYS,
            (
                np.array([scale], np.float32),
                float(incr_ratio),
                float(decr_ratio),
                int(incr_n),
                int(decr_n),
                int(incr),
                int(decr),
                bool(dynamic),
            ),
            strict=True,
        )
    )
