"""Check, then apply: what ``enable`` of every host integration does in that order.

Each check returns the change it found possible (a ``Change``, called later) or raises
``IntegrationError``, so that a refused ``enable`` leaves the trainer, its model and the
process as they were: :func:`apply` runs the changes only once every check has passed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from lossscale_jax.engine._policy import check_policy
from lossscale_jax.errors import IntegrationError, IntegrationWarning
from lossscale_jax.policies import DynamicScale, LossScalePolicy, NoScale

Change = Callable[[], None]
_ENABLED = "_lossscale_jax_enabled"


def apply(changes: Iterable[Change]) -> None:
    """Makes the checked changes, in order."""
    for change in list(changes):
        change()


def refuse_twice(target: Any, host: str) -> Change:
    """Refuses a target ``enable`` was called on before; the change marks it enabled."""
    if getattr(target, _ENABLED, False):
        raise IntegrationError(
            f"lossscale_jax.integrations.{host}.enable() was called on this "
            f"{type(target).__name__} before: its optimizer is already loss-scaled and its "
            "step already takes scaled gradients. Call it once per trainer."
        )
    return lambda: setattr(target, _ENABLED, True)


def default_policy(
    policy: LossScalePolicy | None,
    compute_dtype: Any,
    name: str = "policy",
    stacklevel: int = 3,
) -> LossScalePolicy:
    """``policy``, checked; by default ``DynamicScale()`` for float16 compute (or unknown),
    ``NoScale(skip_on_overflow=True)`` for bfloat16 and float32 (no scale: their range is
    float32's; a non-finite step still skipped). A scale given for those warns, at the
    caller ``stacklevel`` frames up (3: the caller of the function that called this one)."""
    float16 = compute_dtype is None or np.dtype(compute_dtype) == np.float16
    if policy is None:
        return DynamicScale() if float16 else NoScale(skip_on_overflow=True)
    policy = check_policy(policy, name)
    if not float16 and policy.constant_scale != 1.0:
        warnings.warn(
            f"enable(..., compute_dtype={np.dtype(compute_dtype).name}) was given a loss "
            f"scale ({type(policy).__name__}): {np.dtype(compute_dtype).name} has float32's "
            "range and needs none. It is applied as given; leave policy out (no loss scale, "
            "a non-finite step still skipped) unless you want it.",
            IntegrationWarning,
            stacklevel=stacklevel,
        )
    return policy
