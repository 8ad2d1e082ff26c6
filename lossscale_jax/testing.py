"""Testing tools: emulate a saturating float16 device (Ascend NPUs in saturation mode) on CPU.

On Ascend training devices in saturation mode, a float16 operation whose result overflows
writes ``±finfo(float16).max`` (±65504) instead of ``±inf``, and a ``nan`` result becomes 0.
An inf/nan check sees nothing. ``saturating(fn)`` evaluates ``fn`` so that every primitive
producing ``dtype`` values behaves that way, which lets a CPU or GPU test show what such a
device computes.

What is modelled::

  for each primitive of jaxpr(fn), in order (also inside the sub-jaxprs of jit,
  custom_jvp, custom_vjp, cond, scan, while_loop and checkpoint):
      outs = primitive(ins)                         # IEEE, as the host computes it
      for each out of dtype:
          out = where(isnan(out), 0, clip(out, -finfo(dtype).max, finfo(dtype).max))

What is not modelled:

- Results of other dtypes (a float32 intermediate, a ``dot`` with
  ``preferred_element_type=float32``, the float32 loss scale) are left alone.
- Partial results inside one primitive: a ``dot``, reduction or convolution is computed by
  the host (XLA:CPU accumulates float16 dots in float32; ``jnp.sum`` of float16 reduces in
  float32 and converts back) and only its result is clamped. A device that saturates a
  partial sum which later comes back in range is not reproduced.
- The device's float-status register (the overflow flag some frameworks read instead of
  the values), device rounding modes, and bit-exact device kernels.
- Primitives with sub-jaxprs other than those listed above (``shard_map``,
  ``custom_linear_solve``, ``custom_transpose``, ``closed_call``, Pallas kernels, ...):
  they raise ``NotImplementedError`` instead of being evaluated without saturation. Inside
  a ``shard_map`` body ``saturating`` works.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax import lax

from lossscale_jax.engine import _tracers
from lossscale_jax.engine._jaxprs import ClosedJaxpr

__all__ = ["saturate", "saturating"]

# Primitives whose sub-jaxprs are evaluated with saturation, and the params holding them.
_SUBJAXPR_PARAMS: dict[str, tuple[str, ...]] = {
    "jit": ("jaxpr",),
    "pjit": ("jaxpr",),  # jit's name in older jax
    "remat2": ("jaxpr",),  # jax.checkpoint
    "custom_jvp_call": ("call_jaxpr",),
    "custom_vjp_call": ("call_jaxpr",),
    "cond": ("branches",),
    "scan": ("jaxpr",),
    "while": ("cond_jaxpr", "body_jaxpr"),
}


def _validate_dtype(dtype: Any) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(
            f"dtype must be a real floating dtype such as jnp.float16, got {dtype!r}."
        ) from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"dtype must be a real floating dtype such as jnp.float16, got {dt.name}.")
    return dt


def _has_dtype(x: Any, dtype: np.dtype) -> bool:
    """Whether ``x`` (an array or an aval) has dtype ``dtype``; False for PRNG keys, tokens."""
    try:
        return np.dtype(x.dtype) == dtype
    except (AttributeError, TypeError):
        return False


def _saturate_array(x: jax.Array) -> jax.Array:
    # lax, not jnp: the result keeps x's exact type, weak_type included, so a rewritten
    # scan/while body still returns the carry type it takes.
    big = np.asarray(jnp.finfo(x.dtype).max, x.dtype)
    clipped = lax.clamp(-big, x, big)  # nan stays nan through clamp
    return lax.select(lax.ne(clipped, clipped), lax.full_like(clipped, 0), clipped)


def saturate(x: Any, dtype: Any = jnp.float16) -> Any:
    """Clamps the ``dtype`` leaves of ``x`` the way a saturating device writes them.

    Rule::

      for each leaf of x whose dtype is dtype:
          leaf = 0                   if isnan(leaf)
                 finfo(dtype).max    if leaf >= finfo(dtype).max    (+inf included)
                 -finfo(dtype).max   if leaf <= -finfo(dtype).max   (-inf included)
                 leaf                otherwise
      leaves of other dtypes are returned unchanged

    Args:
      x: a pytree of arrays.
      dtype: the saturating dtype; default float16.

    Returns:
      ``x`` with its ``dtype`` leaves saturated.

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale_jax as lsj
      >>> x = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 1.0], jnp.float16)
      >>> lsj.testing.saturate(x).tolist()
      [65504.0, -65504.0, 0.0, 1.0]
    """
    dt = _validate_dtype(dtype)

    def leaf(a: Any) -> Any:
        if _has_dtype(a, dt):
            return _saturate_array(jnp.asarray(a))
        return a

    return jax.tree_util.tree_map(leaf, x)


def _check_aval(aval: Any) -> Any:
    if not (hasattr(aval, "shape") and hasattr(aval, "dtype")):
        raise NotImplementedError(
            f"saturating cannot evaluate a sub-jaxpr that takes a {type(aval).__name__} "
            "(tokens, references)."
        )
    return aval


def _saturate_closed(closed: Any, dtype: np.dtype) -> Any:
    """A ClosedJaxpr computing ``closed`` with saturation, with the same input/output types."""
    # The avals themselves, not ShapeDtypeStructs: weak types and shard_map's varying manual
    # axes must survive, or a rewritten scan/while body changes its carry type.
    avals = [_check_aval(a) for a in closed.in_avals]
    return jax.make_jaxpr(lambda *args: _eval(closed.jaxpr, closed.consts, args, dtype))(*avals)


def _saturate_open(jaxpr: jex.Jaxpr, dtype: np.dtype, name: str) -> jex.Jaxpr:
    if jaxpr.constvars:
        raise NotImplementedError(f"saturating: unexpected constvars in the jaxpr of {name}.")
    new = _saturate_closed(ClosedJaxpr(jaxpr, []), dtype)
    if new.consts:
        raise NotImplementedError(
            f"saturating: the rewritten jaxpr of {name} needs constants; cannot rebind it."
        )
    return new.jaxpr


def _saturate_param(value: Any, dtype: np.dtype, name: str) -> Any:
    if isinstance(value, ClosedJaxpr):
        return _saturate_closed(value, dtype)
    if isinstance(value, jex.Jaxpr):
        return _saturate_open(value, dtype, name)
    if isinstance(value, tuple | list):
        return type(value)(_saturate_param(v, dtype, name) for v in value)
    raise NotImplementedError(f"saturating: unexpected {type(value).__name__} in {name}'s params.")


def _saturate_params(eqn: Any, dtype: np.dtype) -> dict[str, Any]:
    name = eqn.primitive.name
    keys = _SUBJAXPR_PARAMS.get(name)
    if keys is None:
        if any(True for _ in jex.jaxprs_in_params(eqn.params)):
            raise NotImplementedError(
                f"saturating does not handle the higher-order primitive {name!r}: its "
                "sub-computation would run without saturation. Handled: "
                f"{', '.join(sorted(_SUBJAXPR_PARAMS))}."
            )
        return eqn.params
    params = dict(eqn.params)
    for key in keys:
        params[key] = _saturate_param(params[key], dtype, name)
    return params


def _eval(jaxpr: jex.Jaxpr, consts: Any, args: Any, dtype: np.dtype) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex.Literal) else env[v]

    def write(v: Any, x: Any) -> None:
        if not isinstance(v, jex.DropVar):
            env[v] = x

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        write(v, x)
    for v, x in zip(jaxpr.invars, args, strict=True):
        write(v, x)
    for eqn in jaxpr.eqns:
        params = _saturate_params(eqn, dtype)
        bind_params = eqn.primitive.get_bind_params(params)
        subfuns: Any = ()
        if isinstance(bind_params, tuple):  # older jax returns (subfuns, params)
            subfuns, bind_params = bind_params
        ctx = getattr(eqn, "ctx", None)
        with _tracers.replaying(eqn), getattr(ctx, "manager", None) or contextlib.nullcontext():
            outs = eqn.primitive.bind(*subfuns, *map(read, eqn.invars), **bind_params)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        for v, x in zip(eqn.outvars, outs, strict=True):
            if _has_dtype(v.aval, dtype):
                x = _saturate_array(x)
            write(v, x)
    return [read(v) for v in jaxpr.outvars]


def saturating(fn: Callable[..., Any], dtype: Any = jnp.float16) -> Callable[..., Any]:
    """Transforms ``fn`` to compute the way a saturating device (Ascend NPU) does.

    Rule::

      saturating(fn)(*args) evaluates the jaxpr of fn(*args) primitive by primitive:
          out = primitive(ins)                      # the host's IEEE result
          if out.dtype == dtype:
              out = 0 where isnan(out), else clip(out, -finfo(dtype).max, finfo(dtype).max)
      recursing into the sub-jaxprs of jit, custom_jvp_call, custom_vjp_call, cond, scan,
      while and remat2 (jax.checkpoint)

    Applied to a gradient function, ``saturating(jax.grad(loss))``, it saturates the
    backward pass as well; ``jax.grad(saturating(loss))`` instead differentiates the clamps
    (zero where a value saturated) and computes the backward pass in IEEE arithmetic. It
    works under ``jit``, ``vmap``, inside a ``shard_map`` body and inside a training step;
    ``fn`` is traced once per call (once per compilation under ``jit``). Results of other
    dtypes, e.g. float32 intermediates, are not clamped, and a primitive's internal partial
    sums are not either (only its result). Any other primitive holding a sub-jaxpr (e.g.
    ``shard_map``, ``custom_linear_solve``) raises ``NotImplementedError``.

    Args:
      fn: a function of arrays (pytrees of arrays in, pytree of arrays out). Bind static
        arguments with ``functools.partial`` first.
      dtype: the dtype whose results saturate; default float16.

    Returns:
      A function with the signature of ``fn``.

    Raises:
      TypeError: if ``fn`` is not callable or ``dtype`` is not a real floating dtype.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import lossscale_jax as lsj
      >>> f = lambda x: (x * 1000.0) / 1000.0          # x * 1000 overflows float16
      >>> x = jnp.array([100.0, 1.0], jnp.float16)
      >>> f(x)
      Array([inf,  1.], dtype=float16)
      >>> jax.jit(lsj.testing.saturating(f))(x)
      Array([65.5,  1. ], dtype=float16)
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r} ({type(fn).__name__}).")
    dt = _validate_dtype(dtype)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)
        flat = [
            x if isinstance(x, jax.Array) else jnp.asarray(x)
            for x in jax.tree_util.tree_leaves((args, kwargs))
        ]
        outs = _eval(closed.jaxpr, closed.consts, flat, dt)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return wrapped
