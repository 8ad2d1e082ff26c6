"""Keras 3 (``keras/src/optimizers/loss_scale_optimizer.py``).

``LossScaleOptimizer`` builds the transformation; ``import_state`` /
``export_state`` convert the optimizer's ``dynamic_scale`` and
``step_counter`` variables to and from a policy and state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import optax

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _INF,
    _TINY,
    _build,
    _clip,
    _host,
    _int,
    _number,
    _require_policy,
    _resumed,
    _saved_int,
    _saved_scale,
)
from lossscale_jax.policies import LossScaleState
from lossscale_jax.transform import loss_scaling

__all__ = [
    "policy",
    "LossScaleOptimizer",
    "import_state",
    "export_state",
]

# Keras's base-optimizer arguments that LossScaleOptimizer refuses unless at their defaults
# (they belong on the inner optimizer).
_BASE_DEFAULTS: dict[str, Any] = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


def policy(
    initial_scale: float = 2.0**15, dynamic_growth_steps: int = 2000
) -> policies.DynamicScale:
    """The policy inside ``LossScaleOptimizer(inner, initial_scale, dynamic_growth_steps)``.

    ``lsj.loss_scaling(inner, policy(...))`` is that optimizer; keep the
    policy to ``export_state`` a run started here.

    Rule::

      DynamicScale(init_scale=initial_scale, growth_factor=2, backoff_factor=0.5,
                   growth_interval=dynamic_growth_steps, min_scale=2**-126, max_scale=inf)

    Args:
      initial_scale: the starting scale.
      dynamic_growth_steps: good steps before a growth.

    Returns:
      A ``DynamicScale``.

    Examples:
      >>> from lossscale_jax import compat
      >>> compat.keras.policy(2.0**15, 100).growth_interval
      100
    """
    return _build(
        policies.DynamicScale,
        {"init_scale": "initial_scale", "growth_interval": "dynamic_growth_steps"},
        init_scale=_number("initial_scale", initial_scale),
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=_int("dynamic_growth_steps", dynamic_growth_steps),
        min_scale=_TINY,
        max_scale=_INF,
    )


_policy = policy  # for the functions below, whose ``policy`` names shadow it


def LossScaleOptimizer(
    inner_optimizer: optax.GradientTransformation,
    initial_scale: float = 2.0**15,
    dynamic_growth_steps: int = 2000,
    name: str | None = None,
    **kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
    """Keras 3's ``LossScaleOptimizer``: skip and halve on inf/nan, double after N good steps.

    Rule (``stateless_apply``)::

      if all(isfinite(grads)):
          if step_counter == dynamic_growth_steps - 1:
              scale = scale * 2; step_counter = 0
          else:
              step_counter += 1
          inner.apply(grads / scale)
      else:
          scale = scale / 2; step_counter = 0     # the step is skipped

    Keras has no bounds (its scale can reach 0 or inf); here it stays in
    ``[2**-126, float32 max]``. The keyword arguments are checked as Keras
    checks them: ``dynamic=True`` is accepted, ``dynamic=False`` and any
    base-optimizer argument away from its default (``clipnorm``,
    ``weight_decay``, ...) are refused (set them on the inner optimizer:
    ``optax.chain(optax.clip_by_global_norm(...), inner)``).

    Args:
      inner_optimizer: the inner optax transformation.
      initial_scale: the starting scale.
      dynamic_growth_steps: good steps before a growth.
      name: accepted for signature compatibility (optax has no names).
      **kwargs: ``dynamic=True``, or Keras's base-optimizer arguments at their
        defaults (what old saved configs carry).

    Returns:
      A ``loss_scaling`` transformation (``overflow="ieee"``).

    Raises:
      ValueError: for ``dynamic=False``, a base-optimizer argument away from
        its default, or an unknown argument (in Keras's words).

    Examples:
      >>> import optax
      >>> from lossscale_jax import compat
      >>> tx = compat.keras.LossScaleOptimizer(optax.sgd(0.1))
    """
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str or None, got {name!r}.")
    if not kwargs.pop("dynamic", True):
        raise ValueError(
            "LossScaleOptimizer no longer supports `dynamic=False`. Instead, simply set "
            "`loss_scale_factor` directly on the `inner_optimizer` (here: "
            "lossscale_jax.loss_scaling(inner, lossscale_jax.StaticScale(scale)))."
        )
    for arg, default in _BASE_DEFAULTS.items():
        if arg in kwargs:
            value = kwargs.pop(arg)
            if (default is None and value is not None) or value != default:
                raise ValueError(
                    f"LossScaleOptimizer does not support `{arg}`. Instead, set `{arg}` on the "
                    "`inner_optimizer`."
                )
    if kwargs:
        raise ValueError(f"LossScaleOptimizer does not support arguments: `{'`, `'.join(kwargs)}`.")
    return loss_scaling(
        inner_optimizer, _policy(initial_scale, dynamic_growth_steps), overflow="ieee"
    )


def _variable(variables: Mapping[str, Any], name: str) -> Any:
    """The value whose key is ``name`` or ends with ``/name`` (a Keras variable path)."""
    found = [k for k in variables if k == name or str(k).endswith("/" + name)]
    if len(found) != 1:
        raise ValueError(
            f"variables must hold exactly one {name!r} entry (a name or a path such as "
            f"'loss_scale_optimizer/{name}'), found {found} among {sorted(map(str, variables))}."
        )
    return variables[found[0]]


def import_state(
    variables: Mapping[str, Any], dynamic_growth_steps: int = 2000
) -> tuple[policies.DynamicScale, LossScaleState]:
    """The policy and state of a Keras ``LossScaleOptimizer``'s variables.

    Rule::

      policy = the LossScaleOptimizer policy (initial_scale=dynamic_scale,
                                              dynamic_growth_steps)
      state: scale = dynamic_scale, growth_count = step_counter

    Args:
      variables: ``{v.path: v.numpy() for v in optimizer.variables}`` (or any
        mapping whose keys end with ``dynamic_scale`` and ``step_counter``;
        the inner optimizer's entries are ignored).
      dynamic_growth_steps: the optimizer's ``dynamic_growth_steps`` (in its
        ``get_config()``; Keras does not store it in a variable).

    Returns:
      ``(policy, state)``; ``lsj.loss_scaling(inner, policy)`` is the
      transformation ``compat.keras.LossScaleOptimizer`` builds.

    Raises:
      ValueError: for a missing entry, a saved scale that is not finite and > 0, or a
        counter outside the original's range. TypeError: for a value that is not a number.

    Examples:
      >>> from lossscale_jax import compat
      >>> policy, state = compat.keras.import_state(
      ...     {"loss_scale_optimizer/dynamic_scale": 4096.0,
      ...      "loss_scale_optimizer/step_counter": 12}, dynamic_growth_steps=100)
      >>> float(state.scale), int(state.growth_count)
      (4096.0, 12)
    """
    if not isinstance(variables, Mapping):
        raise TypeError(
            "variables must be a mapping of variable path -> value, e.g. "
            f"{{v.path: v.numpy() for v in optimizer.variables}}, got {type(variables).__name__}."
        )
    scale = _saved_scale("dynamic_scale", _variable(variables, "dynamic_scale"))
    policy = _policy(_clip(scale, _TINY, _INF), dynamic_growth_steps)
    counter = _saved_int(
        "step_counter", _variable(variables, "step_counter"), 0, policy.growth_interval - 1
    )
    return policy, _resumed(policy, growth_count=counter)


def export_state(policy: policies.DynamicScale, state: LossScaleState) -> dict[str, Any]:
    """The ``dynamic_scale`` and ``step_counter`` values for a policy and state.

    Rule::

      {"dynamic_scale": float32(state.scale), "step_counter": int32(state.growth_count)}

    In Keras: ``optimizer.dynamic_scale.assign(d["dynamic_scale"])`` and
    ``optimizer.step_counter.assign(d["step_counter"])`` (after ``build``).

    Args:
      policy: ``compat.keras.policy(...)`` (the policy of
        ``LossScaleOptimizer``) or the one ``import_state`` returned.
      state: its ``LossScaleState``.

    Returns:
      A dict of two NumPy 0-d arrays.

    Raises:
      ValueError: if ``policy`` is not one Keras's LossScaleOptimizer can express.
      TypeError: if ``state`` is not a ``LossScaleState``.

    Examples:
      >>> from lossscale_jax import compat
      >>> policy, state = compat.keras.import_state(
      ...     {"dynamic_scale": 4096.0, "step_counter": 12}, dynamic_growth_steps=100)
      >>> d = compat.keras.export_state(policy, policy.adjust(state, False))
      >>> float(d["dynamic_scale"]), int(d["step_counter"])
      (4096.0, 13)
    """
    scale, count, _ = _host(state)
    if not isinstance(policy, policies.DynamicScale):
        raise ValueError(
            f"policy {policy!r} has no Keras equivalent: export needs the policy of "
            "compat.keras.LossScaleOptimizer (compat.keras.import_state returns it)."
        )
    expected = _policy(policy.init_scale, policy.growth_interval)
    _require_policy(policy, expected, "Keras", "compat.keras.LossScaleOptimizer")
    return {"dynamic_scale": np.float32(scale), "step_counter": np.int32(count)}
