"""Argument checks shared by the compat modules, worded in the originals' argument names."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any, TypeVar

import jax.numpy as jnp
import numpy as np

from lossscale_jax.policies import LossScalePolicy, LossScaleState

_TINY = float(np.finfo(np.float32).tiny)  # 2**-126, smallest normal float32
_F32_MAX = float(np.finfo(np.float32).max)
_INF = float("inf")

_Policy = TypeVar("_Policy", bound=LossScalePolicy)


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


def _whole(name: str, value: Any) -> int:
    """An int, or a number with an integral value (jmp accepts ``period=5.``)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}.")
    number = _number(name, value)
    if not number.is_integer():
        raise ValueError(f"{name} must be a whole number, got {value!r}.")
    return int(number)


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
    return int(value)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__}).")
    return bool(value)


def _build(cls: type[_Policy], names: dict[str, str], **kwargs: Any) -> _Policy:
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


# --------------------------------------------------------------------------
# Checkpoint import and export: reading the originals' saved values.


def _field(source: Any, key: str, what: str) -> Any:
    """``source[key]`` of a mapping, else ``source.key`` of an object (a scaler itself)."""
    if isinstance(source, Mapping):
        if key not in source:
            raise ValueError(
                f"{what} has no {key!r} entry (keys: {sorted(map(str, source))}); pass what "
                "the original saves, unchanged."
            )
        return source[key]
    if not hasattr(source, key):
        raise ValueError(
            f"{what} has no {key!r}: pass a dict of what the original saves, or the original "
            f"object itself; got {type(source).__name__}."
        )
    return getattr(source, key)


def _has(source: Any, key: str) -> bool:
    return key in source if isinstance(source, Mapping) else hasattr(source, key)


def _saved_array(name: str, value: Any) -> np.ndarray:
    """A saved value as a NumPy array with one element (0-d, or shape (1,) like Megatron's)."""
    if isinstance(value, bool | str) or value is None:
        raise TypeError(f"{name} must be a number, got {value!r}.")
    try:
        arr = np.asarray(value)
    except Exception as e:  # pragma: no cover - exotic objects
        raise TypeError(f"{name} must be a number, got {value!r}.") from e
    if arr.size != 1 or not np.issubdtype(arr.dtype, np.number) or np.iscomplexobj(arr):
        raise TypeError(f"{name} must be one real number, got {value!r}.")
    return arr.reshape(())


def _saved_scale(name: str, value: Any) -> float:
    """A saved loss scale: a finite number > 0 (a Python float, or a one-element array)."""
    scale = float(_saved_array(name, value))
    if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(
            f"{name} must be a finite number > 0 to resume from, got {value!r} (a run whose "
            "scale reached 0 or inf cannot train; start a fresh policy instead)."
        )
    return scale


def _saved_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """A saved counter: an integer (Python int or integer array) in ``[minimum, maximum]``."""
    arr = _saved_array(name, value)
    if not (np.issubdtype(arr.dtype, np.integer) or float(arr).is_integer()):
        raise TypeError(f"{name} must be an integer, got {value!r}.")
    count = int(arr)
    if count < minimum or (maximum is not None and count > maximum):
        top = "" if maximum is None else f", {maximum}"
        raise ValueError(f"{name} must be in [{minimum}{top}], got {count}.")
    return count


def _clip(scale: float, lo: float, hi: float) -> float:
    """The saved scale inside the policy's bounds (this library's floor of ``2**-126``)."""
    return min(max(scale, lo), hi)


def _resumed(policy: LossScalePolicy, **fields: Any) -> LossScaleState:
    """``policy.init()`` with ``fields`` replaced, each in the dtype ``init()`` gives it.

    Fields this function is not told about (telemetry, and any field a later
    version adds) keep their initial values.
    """
    state = policy.init()
    return state.replace(**{k: jnp.asarray(v, getattr(state, k).dtype) for k, v in fields.items()})


def _host(state: LossScaleState) -> tuple[float, int, int]:
    """``(scale, growth_count, hysteresis_count)`` of a state, read on the host."""
    if not isinstance(state, LossScaleState):
        raise TypeError(
            f"state must be a LossScaleState (lsj.get_loss_scale_state(opt_state)), got "
            f"{type(state).__name__}."
        )
    return (
        float(np.asarray(state.scale)),
        int(np.asarray(state.growth_count)),
        int(np.asarray(state.hysteresis_count)),
    )


def _require_policy(policy: Any, expected: LossScalePolicy, framework: str, builder: str) -> None:
    """Raises unless ``policy`` is the one ``builder`` makes (its starting scale aside)."""
    if not isinstance(policy, LossScalePolicy):
        raise TypeError(f"policy must be a lossscale_jax policy, got {policy!r}.")
    if type(policy) is not type(expected):
        raise ValueError(
            f"policy {policy!r} has no {framework} equivalent: export needs a policy built by "
            f"{builder} (a {type(expected).__name__})."
        )
    # The type check above makes `policy` a dataclass like `expected`; the checker cannot see it.
    diff = [
        f"{f.name}={getattr(policy, f.name)!r} (the original needs {getattr(expected, f.name)!r})"
        for f in dataclasses.fields(policy)  # pyright: ignore[reportArgumentType]
        if f.name != "init_scale" and getattr(policy, f.name) != getattr(expected, f.name)
    ]
    if diff:
        raise ValueError(
            f"policy {policy!r} has no {framework} equivalent: export needs a policy built by "
            f"{builder}; it differs in {', '.join(diff)}."
        )
