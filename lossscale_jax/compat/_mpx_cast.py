"""mpx's casts (``mpx/_cast.py``, ``mpx/_dtypes.py``): which leaves become which dtype.

A leaf is cast when it is an array (``eqx.is_array``: a JAX or NumPy array or NumPy
scalar) of dtype float16, bfloat16 or float32; everything else (float64 arrays, integer
arrays, Python numbers, functions held by a module) is returned as it is.
``cast_to_half_precision`` casts to the dtype ``set_half_precision_datatype`` chose
(float16 unless set), which ``filter_grad`` and ``filter_value_and_grad`` cast their
arguments to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp

T = TypeVar("T")

_CAST_FROM = (jnp.float16, jnp.bfloat16, jnp.float32)
_HALF_NAMES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}
_half: list[Any] = [jnp.float16]  # the half-precision dtype the casts and gradients use


def half_precision_datatype() -> Any:
    """The half-precision dtype: float16 unless ``set_half_precision_datatype`` chose bfloat16.

    Examples:
      >>> from lossscale_jax.compat import mpx
      >>> mpx.half_precision_datatype()
      <class 'jax.numpy.float16'>
    """
    return _half[0]


def set_half_precision_datatype(datatype: Any) -> None:
    """Chooses the half-precision dtype: ``jnp.float16`` or ``jnp.bfloat16`` (or their names).

    mpx 0.1.8 accepts the names ``"float16"`` and ``"bfloat16"`` but keeps the dtype it had
    (its code converts the name and never stores it); here a name sets the dtype it names.

    Raises:
      ValueError: for another name. TypeError: for anything else, as mpx.

    Examples:
      >>> import jax.numpy as jnp
      >>> from lossscale_jax.compat import mpx
      >>> mpx.set_half_precision_datatype("bfloat16")
      >>> mpx.cast_to_half_precision(jnp.ones(2)).dtype
      dtype(bfloat16)
      >>> mpx.set_half_precision_datatype(jnp.float16)
    """
    if isinstance(datatype, str):
        if datatype not in _HALF_NAMES:
            raise ValueError(f"Unsupported datatype: {datatype!r}. Use 'float16' or 'bfloat16'.")
        datatype = _HALF_NAMES[datatype]
    elif datatype not in (jnp.float16, jnp.bfloat16):
        raise TypeError(
            f"datatype must be 'float16', 'bfloat16', jnp.float16 or jnp.bfloat16, got "
            f"{datatype!r}."
        )
    _half[0] = datatype


def cast_tree(tree: T, dtype: Any) -> T:
    """``tree`` with every float16, bfloat16 and float32 array leaf cast to ``dtype``.

    Rule::

      leaf.astype(dtype) if is_array(leaf) and leaf.dtype in (f16, bf16, f32) else leaf

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from lossscale_jax.compat import mpx
      >>> tree = {"w": jnp.ones(2), "n": np.arange(2), "f": 1.0, "act": jnp.tanh}
      >>> out = mpx.cast_tree(tree, jnp.float16)
      >>> out["w"].dtype, out["n"].dtype, out["f"], out["act"] is jnp.tanh
      (dtype('float16'), dtype('int64'), 1.0, True)
    """

    def cast(x: Any) -> Any:
        if eqx.is_array(x) and x.dtype in _CAST_FROM:
            return x.astype(dtype)
        return x

    return jax.tree_util.tree_map(cast, tree)


def cast_to_float32(x: T) -> T:
    """``cast_tree(x, jnp.float32)``."""
    return cast_tree(x, jnp.float32)


def cast_to_float16(x: T) -> T:
    """``cast_tree(x, jnp.float16)``."""
    return cast_tree(x, jnp.float16)


def cast_to_bfloat16(x: T) -> T:
    """``cast_tree(x, jnp.bfloat16)``."""
    return cast_tree(x, jnp.bfloat16)


def cast_to_full_precision(x: T) -> T:
    """``cast_tree(x, jnp.float32)``."""
    return cast_tree(x, jnp.float32)


def cast_to_half_precision(x: T) -> T:
    """``cast_tree(x, half_precision_datatype())``."""
    return cast_tree(x, half_precision_datatype())


def cast_function(
    func: Callable[..., Any], dtype: Any, return_dtype: Any = None
) -> Callable[..., Any]:
    """``func`` with its arguments cast to ``dtype`` and its results to ``return_dtype``.

    Rule::

      results = func(*cast_tree(args, dtype), **cast_tree(kwargs, dtype))
      tuple -> each element cast_tree(..., return_dtype); an array -> cast; else as it is

    ``return_dtype`` defaults to ``dtype``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from lossscale_jax.compat import mpx
      >>> f = lambda x: jnp.sum(x * x) / 1e4           # x * x overflows float16
      >>> x = jnp.full(4, 300.0, jnp.float16)
      >>> float(f(x)), float(mpx.cast_function(f, jnp.float32, jnp.float16)(x))
      (inf, 36.0)
    """
    if return_dtype is None:
        return_dtype = dtype

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args_cast = tuple(cast_tree(arg, dtype) for arg in args)
        kwargs_cast = {key: cast_tree(value, dtype) for key, value in kwargs.items()}
        results = func(*args_cast, **kwargs_cast)
        if type(results) is tuple:
            return tuple(cast_tree(r, return_dtype) for r in results)
        if eqx.is_array(results):
            return cast_tree(results, return_dtype)
        return results

    return wrapper


def force_full_precision(
    func: Callable[..., Any], return_dtype: Any = jnp.float16
) -> Callable[..., Any]:
    """``func`` computed in float32, its results cast to ``return_dtype`` (float16 default).

    ``cast_function(func, jnp.float32, return_dtype)``: for the reductions (mean, sum,
    softmax, layer norm) that overflow or lose precision in float16.

    Examples:
      >>> import jax.numpy as jnp
      >>> from lossscale_jax.compat import mpx
      >>> mpx.force_full_precision(jnp.mean, jnp.float32)(jnp.ones(3, jnp.float16)).dtype
      dtype('float32')
    """
    return cast_function(func, jnp.float32, return_dtype)
