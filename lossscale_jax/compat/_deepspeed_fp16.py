"""DeepSpeed's fp16 optimizers without ZeRO: ``FP16_Optimizer``, ``FP16_UnfusedOptimizer``.

Re-exported by ``compat.deepspeed`` (see its docstring): their own ``_update_scale``
rule, the optimizers around it, and their ``state_dict()`` import and export.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _INF,
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
from lossscale_jax.engine._ops import where
from lossscale_jax.policies import LossScalePolicy, LossScaleState, StaticScale
from lossscale_jax.transform import loss_scaling

__all__ = [
    "fp16_optimizer_policy",
    "FP16_Optimizer",
    "FP16_UnfusedOptimizer",
    "import_fp16_optimizer_state",
    "export_fp16_optimizer_state",
]


def _good_steps(cur_iter: int, last_overflow_iter: int) -> int:
    """Good steps since the last overflow (or the start): DeepSpeed's ``stable_interval``."""
    n = cur_iter - last_overflow_iter - 1
    if n < 0:
        raise ValueError(
            f"last_overflow_iter ({last_overflow_iter}) must be < cur_iter ({cur_iter})."
        )
    return n


@dataclasses.dataclass(frozen=True)
class _FP16OptimizerScale(policies.DynamicScale):
    """``DynamicScale`` whose count restarts at 1 after a growth (DeepSpeed's ``_update_scale``).

    With ``growth_interval = scale_window + 1``: the first growth after an
    overflow (or the start) comes on the ``scale_window + 1``-th good step,
    each later one ``scale_window`` good steps after the previous.
    """

    def adjust(
        self, state: LossScaleState, overflow: ArrayLike, amax: ArrayLike | None = None
    ) -> LossScaleState:
        new = super().adjust(state, overflow)
        grew = jnp.logical_and(
            jnp.logical_not(jnp.asarray(overflow, jnp.bool_)),
            state.growth_count >= self.growth_interval - 1,
        )
        return new.replace(growth_count=where(grew, jnp.ones([], jnp.int32), new.growth_count))


_DYNAMIC_LOSS_ARGS = ("init_scale", "scale_window", "min_scale")
# Passed by the engine (``get_dynamic_loss_scale_args``) and ignored by the fp16 optimizers.
_IGNORED_LOSS_ARGS = ("delayed_shift", "consecutive_hysteresis")


def fp16_optimizer_policy(
    static_loss_scale: float = 1.0,
    dynamic_loss_scale: bool = False,
    initial_dynamic_scale: float = 2.0**32,
    dynamic_loss_args: Mapping[str, Any] | None = None,
    *,
    unfused: bool = False,
) -> LossScalePolicy:
    """The policy ``FP16_Optimizer`` (or, with ``unfused``, ``FP16_UnfusedOptimizer``) sets up.

    ``lsj.loss_scaling(inner, fp16_optimizer_policy(...))`` is that
    optimizer; keep the policy to ``export_fp16_optimizer_state`` a run
    started here. See ``FP16_Optimizer`` for the rule.

    Rule (``__init__`` of the optimizers)::

      not dynamic_loss_scale: StaticScale(static_loss_scale)   # still skips overflows
      dynamic_loss_args None: init initial_dynamic_scale (unfused: 2**16),
                              scale_window 1000, min 1 (unfused: 0.25)
      else: init_scale, scale_window, min_scale from dynamic_loss_args

    Args:
      static_loss_scale, dynamic_loss_scale, initial_dynamic_scale, dynamic_loss_args:
        as ``FP16_Optimizer`` takes them (``FP16_UnfusedOptimizer`` has no
        ``initial_dynamic_scale``: leave it at its default with ``unfused=True``).
      unfused: the defaults of ``FP16_UnfusedOptimizer``.

    Returns:
      A ``StaticScale`` or the fp16 optimizers' dynamic policy (a
      ``DynamicScale`` with ``growth_interval = scale_window + 1`` whose count
      restarts at 1 after a growth).

    Raises:
      ValueError: for missing or unknown ``dynamic_loss_args`` keys, or
        ``initial_dynamic_scale`` with ``unfused=True``.

    Examples:
      >>> from lossscale_jax import compat
      >>> p = compat.deepspeed.fp16_optimizer_policy(
      ...     dynamic_loss_scale=True,
      ...     dynamic_loss_args={"init_scale": 2**8, "scale_window": 2, "min_scale": 1})
      >>> p.growth_interval, p.min_scale
      (3, 1.0)
    """
    if _bool("unfused", unfused):
        if initial_dynamic_scale != 2.0**32:
            raise ValueError(
                "initial_dynamic_scale is not an argument of FP16_UnfusedOptimizer (it starts "
                "at 2**16 without dynamic_loss_args); pass dynamic_loss_args instead."
            )
        initial_dynamic_scale, default_min = 2.0**16, 0.25
    else:
        default_min = 1.0
    if not _bool("dynamic_loss_scale", dynamic_loss_scale):
        return _build(
            StaticScale,
            {"scale": "static_loss_scale"},
            scale=_number("static_loss_scale", static_loss_scale),
        )
    if dynamic_loss_args is None:
        init, window, lo = initial_dynamic_scale, 1000, default_min
    else:
        if not isinstance(dynamic_loss_args, Mapping):
            raise TypeError(
                f"dynamic_loss_args must be a dict with keys {_DYNAMIC_LOSS_ARGS} (DeepSpeed's "
                f"INITIAL_LOSS_SCALE, SCALE_WINDOW, MIN_LOSS_SCALE), got {dynamic_loss_args!r}."
            )
        missing = [k for k in _DYNAMIC_LOSS_ARGS if k not in dynamic_loss_args]
        unknown = sorted(
            str(k) for k in dynamic_loss_args if k not in _DYNAMIC_LOSS_ARGS + _IGNORED_LOSS_ARGS
        )
        if missing or unknown:
            raise ValueError(
                f"dynamic_loss_args must have the keys {list(_DYNAMIC_LOSS_ARGS)} (and may have "
                f"{list(_IGNORED_LOSS_ARGS)}, which these optimizers ignore); missing {missing}, "
                f"unknown {unknown}."
            )
        init = dynamic_loss_args["init_scale"]
        window = dynamic_loss_args["scale_window"]
        lo = dynamic_loss_args["min_scale"]
    return _fp16_dynamic(
        _number("init_scale", init), 2.0, _int("scale_window", window), _number("min_scale", lo)
    )


def _fp16_dynamic(init: float, factor: float, window: int, lo: float) -> LossScalePolicy:
    if window < 1:
        raise ValueError(f"scale_window must be an int >= 1, got {window!r}.")
    if not factor > 1.0:
        raise ValueError(f"scale_factor must be > 1, got {factor!r}.")
    return _build(
        _FP16OptimizerScale,
        {"init_scale": "init_scale", "min_scale": "min_scale"},
        init_scale=init,
        growth_factor=factor,
        backoff_factor=1.0 / factor,
        growth_interval=window + 1,
        min_scale=lo,
        max_scale=_INF,
    )


def FP16_Optimizer(
    init_optimizer: optax.GradientTransformation,
    static_loss_scale: float = 1.0,
    dynamic_loss_scale: bool = False,
    initial_dynamic_scale: float = 2.0**32,
    dynamic_loss_args: Mapping[str, Any] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """DeepSpeed's ``FP16_Optimizer`` (fp16 without ZeRO, fused Adam): its own scale rule.

    Rule (``FP16_Optimizer._update_scale``, a Python float scale)::

      if overflow:                                  # the step is skipped
          scale = max(scale / 2, min_loss_scale); last_overflow_iter = cur_iter
      else:
          stable = cur_iter - last_overflow_iter - 1
          if stable > 0 and stable % scale_window == 0: scale *= 2
      cur_iter += 1

    The first growth after an overflow (or the start) comes on the
    ``scale_window + 1``-th good step, the next ones every ``scale_window``
    good steps: one step later than ``DynamicLossScaler`` (ZeRO). No
    hysteresis: the engine passes ``delayed_shift`` and
    ``consecutive_hysteresis`` in ``dynamic_loss_args``, and these optimizers
    ignore them, as here. A static scale still skips overflowing steps.

    Args:
      init_optimizer: the inner optax transformation.
      static_loss_scale: the scale when ``dynamic_loss_scale`` is False.
      dynamic_loss_scale: use the dynamic rule.
      initial_dynamic_scale: the starting dynamic scale when
        ``dynamic_loss_args`` is None (then ``scale_window=1000``,
        ``min_loss_scale=1``).
      dynamic_loss_args: ``{"init_scale", "scale_window", "min_scale"}`` (and
        the ignored ``"delayed_shift"``, ``"consecutive_hysteresis"``), as the
        engine builds it from the ``fp16`` config
        (``init_scale = 2**initial_scale_power``).

    Returns:
      A ``loss_scaling`` transformation (``overflow="ieee"``).

    Raises:
      ValueError, TypeError: as ``fp16_optimizer_policy``.

    Examples:
      >>> import optax
      >>> from lossscale_jax import compat
      >>> tx = compat.deepspeed.FP16_Optimizer(
      ...     optax.adam(1.5e-4), dynamic_loss_scale=True,
      ...     dynamic_loss_args={"init_scale": 2**8, "scale_window": 2, "min_scale": 1})
    """
    policy = fp16_optimizer_policy(
        static_loss_scale, dynamic_loss_scale, initial_dynamic_scale, dynamic_loss_args
    )
    return loss_scaling(init_optimizer, policy, overflow="ieee")


def FP16_UnfusedOptimizer(
    init_optimizer: optax.GradientTransformation,
    static_loss_scale: float = 1.0,
    dynamic_loss_scale: bool = False,
    dynamic_loss_args: Mapping[str, Any] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """DeepSpeed's ``FP16_UnfusedOptimizer`` (fp16 without ZeRO, e.g. LAMB).

    The rule of ``FP16_Optimizer`` (see there); without ``dynamic_loss_args``
    it starts at ``2**16`` with ``scale_window=1000`` and
    ``min_loss_scale=0.25``.

    Args:
      init_optimizer: the inner optax transformation.
      static_loss_scale: the scale when ``dynamic_loss_scale`` is False.
      dynamic_loss_scale: use the dynamic rule.
      dynamic_loss_args: as for ``FP16_Optimizer``.

    Returns:
      A ``loss_scaling`` transformation (``overflow="ieee"``).

    Raises:
      ValueError, TypeError: as ``fp16_optimizer_policy``.

    Examples:
      >>> import optax
      >>> from lossscale_jax import compat
      >>> tx = compat.deepspeed.FP16_UnfusedOptimizer(optax.lamb(1.5e-4), dynamic_loss_scale=True)
    """
    policy = fp16_optimizer_policy(
        static_loss_scale, dynamic_loss_scale, dynamic_loss_args=dynamic_loss_args, unfused=True
    )
    return loss_scaling(init_optimizer, policy, overflow="ieee")


# --------------------------------------------------------------------------
# Checkpoints.


def import_fp16_optimizer_state(
    state_dict: Mapping[str, Any], *, min_loss_scale: float = 1.0
) -> tuple[LossScalePolicy, LossScaleState]:
    """The policy and state of an ``FP16_Optimizer``/``FP16_UnfusedOptimizer`` ``state_dict()``.

    Rule (the keys ``state_dict()`` saves; ``min_loss_scale`` is not saved)::

      dynamic_loss_scale False: StaticScale(cur_scale)
      else: n = cur_iter - last_overflow_iter - 1          # good steps since the overflow
            policy = the FP16_Optimizer rule (scale_factor, scale_window, min_loss_scale)
            growth_count = 0 if n == 0 else (n - 1) % scale_window + 1

    Args:
      state_dict: the optimizer's ``state_dict()`` (the checkpoint's
        ``"optimizer"`` entry); only ``dynamic_loss_scale``, ``cur_scale``,
        ``cur_iter``, ``last_overflow_iter``, ``scale_factor`` and
        ``scale_window`` are read.
      min_loss_scale: the floor the optimizer was built with (DeepSpeed keeps
        it out of the checkpoint): ``dynamic_loss_args["min_scale"]``, else 1
        (``FP16_Optimizer``) or 0.25 (``FP16_UnfusedOptimizer``).

    Returns:
      ``(policy, state)``; ``lsj.loss_scaling(inner, policy)`` is the
      optimizer ``compat.deepspeed.FP16_Optimizer`` builds.

    Raises:
      ValueError: for a missing entry, a saved scale that is not finite and > 0, or a
        counter outside the original's range. TypeError: for a value that is not a number.

    Examples:
      >>> from lossscale_jax import compat
      >>> saved = {"dynamic_loss_scale": True, "cur_scale": 512.0, "cur_iter": 7,
      ...          "last_overflow_iter": 1, "scale_factor": 2, "scale_window": 2}
      >>> policy, state = compat.deepspeed.import_fp16_optimizer_state(saved)
      >>> int(state.growth_count)     # 5 good steps: grew after the 3rd and the 5th
      1
    """
    what = "the FP16_Optimizer state_dict"
    scale = _saved_scale("cur_scale", _field(state_dict, "cur_scale", what))
    if not _bool("dynamic_loss_scale", _field(state_dict, "dynamic_loss_scale", what)):
        policy = StaticScale(scale)
        return policy, policy.init()
    lo = _number("min_loss_scale", min_loss_scale)
    window = _saved_int("scale_window", _field(state_dict, "scale_window", what), 1)
    policy = _fp16_dynamic(
        _clip(scale, lo, _INF),
        _number("scale_factor", _field(state_dict, "scale_factor", what)),
        window,
        lo,
    )
    n = _good_steps(
        _saved_int("cur_iter", _field(state_dict, "cur_iter", what), 0),
        _saved_int("last_overflow_iter", _field(state_dict, "last_overflow_iter", what), -1),
    )
    return policy, _resumed(policy, growth_count=0 if n == 0 else (n - 1) % window + 1)


def export_fp16_optimizer_state(policy: LossScalePolicy, state: LossScaleState) -> dict[str, Any]:
    """The loss-scale entries of an ``FP16_Optimizer.state_dict()`` for a policy and state.

    Rule (the inverse of ``import_fp16_optimizer_state``)::

      cur_iter = max(total_steps, growth_count)
      last_overflow_iter = cur_iter - 1 - growth_count
      static: {"dynamic_loss_scale": False, "cur_scale", "cur_iter"}

    Merge the result into the optimizer's state dict before
    ``load_state_dict`` (its other entries are the inner optimizer's and the
    fp32 master weights).

    Args:
      policy: ``compat.deepspeed.fp16_optimizer_policy(...)`` (the policy of
        ``FP16_Optimizer``), the one ``import_fp16_optimizer_state`` returned,
        or a ``StaticScale``.
      state: its ``LossScaleState``.

    Returns:
      A dict of the keys ``FP16_Optimizer.state_dict()`` writes for the scale.

    Raises:
      ValueError: if ``policy`` is not one FP16_Optimizer can express.
      TypeError: if ``state`` is not a ``LossScaleState``.

    Examples:
      >>> from lossscale_jax import compat
      >>> policy, state = compat.deepspeed.import_fp16_optimizer_state(
      ...     {"dynamic_loss_scale": True, "cur_scale": 512.0, "cur_iter": 7,
      ...      "last_overflow_iter": 1, "scale_factor": 2, "scale_window": 2})
      >>> d = compat.deepspeed.export_fp16_optimizer_state(policy, state)
      >>> d["cur_scale"], d["cur_iter"] - d["last_overflow_iter"] - 1
      (512.0, 1)
    """
    scale, count, _ = _host(state)
    cur_iter = max(int(jnp.asarray(state.total_steps)), count)
    if isinstance(policy, StaticScale) and policy.skip_on_overflow:
        return {"dynamic_loss_scale": False, "cur_scale": scale, "cur_iter": cur_iter}
    if not isinstance(policy, _FP16OptimizerScale):
        raise ValueError(
            f"policy {policy!r} has no FP16_Optimizer equivalent: export needs the policy of "
            "compat.deepspeed.import_fp16_optimizer_state (or FP16_Optimizer's)."
        )
    factor = float(policy.growth_factor)
    expected = _fp16_dynamic(
        policy.init_scale, factor, policy.growth_interval - 1, policy.min_scale
    )
    _require_policy(policy, expected, "FP16_Optimizer", "compat.deepspeed.FP16_Optimizer")
    return {
        "dynamic_loss_scale": True,
        "cur_scale": scale,
        "cur_iter": cur_iter,
        "last_overflow_iter": cur_iter - 1 - count,
        "scale_factor": factor,
        "scale_window": int(policy.growth_interval) - 1,
    }
