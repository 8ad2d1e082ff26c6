"""Checks of hyperparameters: every bad value raises at construction time, naming it.

Hyperparameters are static Python values (a policy is hashable and its fields are
read at trace time); NumPy and 0-d JAX scalars are accepted as the numbers they hold.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.core
import numpy as np

from lossscale_jax.engine._state import F32_MAX, I32_MAX


def concrete(name: str, value: Any) -> Any:
    """``value`` as a Python ``int``/``float``/``bool`` if it is a concrete 0-d scalar.

    Python numbers, NumPy scalars and 0-d NumPy or JAX arrays are accepted alike
    (``np.float64(1024)``, ``jnp.float32(1024)``); a traced value is refused
    (hyperparameters are static: build policies outside ``jit``).
    """
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} must be a concrete number, got a traced value ({value.aval}): "
            "hyperparameters are static Python values; build the policy outside "
            "jax.jit/grad/vmap."
        )
    if isinstance(value, bool | int | float | np.number | np.bool_):
        return value.item() if isinstance(value, np.generic) else value
    if isinstance(value, np.ndarray | jax.Array) and np.shape(value) == ():
        return np.asarray(value).item()
    return value


def check_real(name: str, value: Any) -> float:
    v = concrete(name, value)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__}).")
    return float(v)


def check_positive_finite(name: str, value: Any) -> float:
    v = check_real(name, value)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    if v > F32_MAX:
        raise ValueError(f"{name} must fit in float32 (<= {F32_MAX:.4g}), got {value!r}.")
    if np.float32(v) == 0.0:
        raise ValueError(f"{name} underflows to 0 in float32, got {value!r}.")
    return v


def check_int(name: str, value: Any, minimum: int) -> int:
    v = concrete(name, value)
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
    if not minimum <= v <= I32_MAX:
        raise ValueError(f"{name} must be an int in [{minimum}, {I32_MAX}], got {value!r}.")
    return v


def check_bool(name: str, value: Any) -> bool:
    v = concrete(name, value)
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__}).")
    return v


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> Any:
    """``value`` if it is one of ``choices`` (compared as given), else ``ValueError``."""
    if not any(value is c or (isinstance(value, str) and value == c) for c in choices):
        raise ValueError(f"{name} must be one of {choices}, got {value!r}.")
    return value


def check_scale_range(
    min_scale: Any, max_scale: Any, init_scale: Any | None = None
) -> tuple[float, float, float | None]:
    """``(min_scale, max_scale, init_scale)`` as floats: ``0 < min <= max`` (max may be inf).

    ``init_scale``, when given, must lie in ``[min_scale, max_scale]``.
    """
    lo = check_positive_finite("min_scale", min_scale)
    hi = check_real("max_scale", max_scale)
    if math.isnan(hi) or hi <= 0.0:
        raise ValueError(f"max_scale must be > 0 (or inf), got {max_scale!r}.")
    if lo > hi:
        raise ValueError(f"min_scale ({min_scale!r}) must not exceed max_scale ({max_scale!r}).")
    if init_scale is None:
        return lo, hi, None
    init = check_positive_finite("init_scale", init_scale)
    if not lo <= init <= hi:
        raise ValueError(
            f"init_scale must be in [min_scale, max_scale] = "
            f"[{min_scale!r}, {max_scale!r}], got {init_scale!r}."
        )
    return lo, hi, init


def check_growth_rule(
    growth_factor: Any, backoff_factor: Any, growth_interval: Any
) -> tuple[float, float, int]:
    """The factors and interval every dynamic policy shares, as Python numbers."""
    growth = check_real("growth_factor", growth_factor)
    if not (math.isfinite(growth) and growth > 1.0):
        raise ValueError(f"growth_factor must be a finite number > 1, got {growth_factor!r}.")
    backoff = check_real("backoff_factor", backoff_factor)
    if not 0.0 < backoff < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}.")
    return growth, backoff, check_int("growth_interval", growth_interval, 1)


def check_argnums(argnums: Any) -> tuple[int, ...]:
    """``argnums`` (an int >= 0 or a non-empty sequence of them) as a tuple, else ``ValueError``."""
    nums = (argnums,) if isinstance(argnums, int) else argnums
    if not (
        isinstance(nums, tuple | list)
        and nums
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in nums)
    ):
        raise ValueError(f"argnums must be an int >= 0 or a sequence of them, got {argnums!r}.")
    return tuple(nums)


def store(obj: Any, **values: Any) -> None:
    """Sets validated hyperparameters on a frozen dataclass as plain Python values.

    A policy is hashable and static: a NumPy or JAX scalar given by the user is
    kept as the Python number it stands for.
    """
    for name, value in values.items():
        object.__setattr__(obj, name, value)
