"""Argument checks shared by the compat modules, worded in the originals' argument names."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from lossscale_jax.policies import LossScalePolicy

_TINY = float(np.finfo(np.float32).tiny)  # 2**-126, smallest normal float32
_F32_MAX = float(np.finfo(np.float32).max)
_INF = float("inf")


def _number(name: str, value: Any) -> float:
    """``value`` as a Python float; accepts 0-d arrays (jmp passes ``jnp.asarray(2.**15)``)."""
    if isinstance(value, bool | str) or value is None:
        raise TypeError(f"{name} must be a real number, got {value!r}.")
    try:
        arr = np.asarray(value)
    except Exception as e:  # pragma: no cover - exotic objects
        raise TypeError(f"{name} must be a real number, got {value!r}.") from e
    if arr.shape != () or not np.issubdtype(arr.dtype, np.number) or np.iscomplexobj(arr):
        raise TypeError(f"{name} must be a real scalar, got {value!r}.")
    return float(arr)


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
    return int(value)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__}).")
    return bool(value)


def _build(cls: type, names: dict[str, str], **kwargs: Any) -> LossScalePolicy:
    """``cls(**kwargs)``, with errors worded in the original's argument names."""
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        message = str(e)
        for ours, theirs in names.items():
            message = re.sub(rf"\b{ours}\b", theirs, message)
        raise type(e)(message) from None


def _check_policy(name: str, value: Any) -> LossScalePolicy:
    if not isinstance(value, LossScalePolicy):
        raise TypeError(
            f"{name} must be a loss-scale manager built by lossscale_jax.compat "
            f"(a lossscale_jax policy), got {value!r}."
        )
    return value
