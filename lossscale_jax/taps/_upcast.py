"""A function's float16 computation, evaluated in float32 (the reference ``diagnose`` needs).

``upcast(fun, low)`` traces ``fun`` at its arguments' own dtypes, then evaluates the traced
program (its jaxpr) with every ``low`` value held in float32: inputs, constants and literals
are widened, casts to ``low`` become casts to float32, and every dtype a primitive is told to
produce (``convert_element_type``, ``dot_general``'s ``preferred_element_type``, ``iota``, ...)
follows. The result is the same program in float32, differentiable like any JAX function, so a
user writes the float16 loss once and gets its float32 reference for free.

Calls (``jit``, ``custom_jvp``/``custom_vjp`` functions, ``checkpoint``) are inlined: their
bodies run through the same rewrite (their custom derivatives are not kept; the reference is
differentiated through the body), except a tap's (``lsj.tap``): it is bound again on the
widened value, so the reference records its own activation-gradient statistics. ``scan``,
``cond`` and ``while`` get their bodies rewritten. A primitive the rewrite cannot widen raises
``ValueError`` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from lossscale_jax.engine._jaxprs import ClosedJaxpr
from lossscale_jax.taps._tapping import active, substituted, tap_of_equation

# Primitives whose body is inlined, and the parameter holding it (the layer-map walk of
# _segments follows the same calls).
INLINE_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
}
# Primitives whose sub-programs are rewritten in place, then bound again.
_REBIND = {"scan", "cond", "while"}
_HIGH = np.dtype(np.float32)


class UnsupportedPrimitive(ValueError):
    """A primitive of the traced function that the float32 rewrite cannot evaluate."""


def _is_low(dtype: Any, low: np.dtype) -> bool:
    try:
        return np.dtype(dtype) == low
    except TypeError:
        return False


def _widen(x: Any, low: np.dtype) -> Any:
    if hasattr(x, "dtype") and _is_low(x.dtype, low):
        return x.astype(_HIGH) if isinstance(x, jax.Array) else np.asarray(x, _HIGH)
    return x


def _read(env: dict, v: Any, low: np.dtype) -> Any:
    if isinstance(v, jcore.Literal):
        val = v.val
        dtype = getattr(v.aval, "dtype", None)  # a literal's aval is a ShapedArray
        if dtype is not None and _is_low(dtype, low):
            return np.asarray(val, _HIGH)
        return val
    return env[v]


def _widen_closed(closed: Any, low: np.dtype) -> Any:
    """``closed`` rewritten: its ``low`` inputs, outputs and computations in float32."""
    avals = [
        jax.ShapeDtypeStruct(
            a.shape, _HIGH if _is_low(a.dtype, low) else a.dtype, weak_type=a.weak_type
        )
        for a in closed.in_avals
    ]
    return jax.make_jaxpr(lambda *args: _eval(closed.jaxpr, closed.consts, list(args), low))(*avals)


def _params(name: str, params: dict, low: np.dtype) -> dict:
    out = {}
    for k, v in params.items():
        if isinstance(v, ClosedJaxpr):
            v = _widen_closed(v, low)
        elif isinstance(v, tuple) and v and all(isinstance(b, ClosedJaxpr) for b in v):
            v = tuple(_widen_closed(b, low) for b in v)
        elif isinstance(v, jcore.Jaxpr):
            raise UnsupportedPrimitive(name)
        elif isinstance(v, np.dtype) and v == low:
            v = _HIGH
        out[k] = v
    return out


def _apply(eqn: Any, invals: list, low: np.dtype) -> list:
    prim, params = eqn.primitive, eqn.params
    name = prim.name
    tap = tap_of_equation(params) if name == "custom_vjp_call" else None
    if tap is not None:  # a tap stays a tap (on the widened value): diagnose reads it
        consts = params.get("num_consts", 0)
        return [tap(*invals[consts:])]
    if name in INLINE_CALLS and INLINE_CALLS[name] in params:
        body = params[INLINE_CALLS[name]]
        if isinstance(body, ClosedJaxpr):
            return _eval(body.jaxpr, body.consts, invals, low)
        return _eval(body, [], invals, low)
    if name == "reduce_precision" and _is_low(eqn.invars[0].aval.dtype, low):
        return [invals[0]]  # rounding to float16's precision: the reference keeps float32's
    if name == "bitcast_convert_type" and (
        _is_low(eqn.invars[0].aval.dtype, low) or _is_low(params.get("new_dtype"), low)
    ):
        raise UnsupportedPrimitive(name)
    if any(isinstance(v, jcore.Jaxpr) for v in params.values()) and name not in _REBIND:
        raise UnsupportedPrimitive(name)
    if name not in _REBIND and any(
        isinstance(v, ClosedJaxpr | tuple) and _holds_jaxpr(v) for v in params.values()
    ):
        raise UnsupportedPrimitive(name)
    out = prim.bind(*invals, **_params(name, params, low))
    return list(out) if prim.multiple_results else [out]


def _holds_jaxpr(v: Any) -> bool:
    if isinstance(v, ClosedJaxpr):
        return True
    return isinstance(v, tuple) and any(isinstance(b, ClosedJaxpr) for b in v)


def _eval(jaxpr: jcore.Jaxpr, consts: list, args: list, low: np.dtype) -> list:
    env: dict = {}
    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = _widen(c, low)
    for v, a in zip(jaxpr.invars, args, strict=True):
        env[v] = _widen(a, low)
    for eqn in jaxpr.eqns:
        outs = _apply(eqn, [_read(env, v, low) for v in eqn.invars], low)
        for v, val in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, jcore.DropVar):
                env[v] = val
    return [_read(env, v, low) for v in jaxpr.outvars]


def computes_in(fun: Callable, args: tuple, dtype: Any) -> bool:
    """Whether the program ``fun(*args)`` traces to computes any value of ``dtype``."""
    dtype = np.dtype(dtype)

    def walk(jaxpr: jcore.Jaxpr) -> bool:
        for eqn in jaxpr.eqns:
            if any(_is_low(getattr(v.aval, "dtype", None), dtype) for v in eqn.outvars):
                return True
            for sub in jcore.jaxprs_in_params(eqn.params):
                if walk(sub):
                    return True
        return False

    return walk(jax.make_jaxpr(fun)(*args).jaxpr)


def upcast(fun: Callable, low: Any = jnp.float16) -> Callable:
    """``fun`` with every ``low`` (float16) computation done in float32.

    The returned function takes the arguments ``fun`` takes (``low`` leaves are
    widened to float32) and returns ``fun``'s outputs, ``low`` ones in float32.
    """
    low = np.dtype(low)

    def widened(*args: Any) -> Any:
        # Traced at the arguments' own dtypes: the casts to float16 the function makes
        # (e.g. of float32 master weights) are what the rewrite turns into float32.
        rec = active()
        if rec is None or rec.sinks is None:
            closed, shapes = jax.make_jaxpr(fun, return_shape=True)(*args)
            flat = jax.tree_util.tree_leaves(args)
        else:  # recording taps: the sinks become inputs of the traced program
            sinks = list(rec.sinks.values)

            def with_sinks(values: list[Any], *args: Any) -> Any:
                with substituted(values):
                    return fun(*args)

            closed, shapes = jax.make_jaxpr(with_sinks, return_shape=True)(sinks, *args)
            flat = sinks + jax.tree_util.tree_leaves(args)
        out = _eval(closed.jaxpr, closed.consts, flat, low)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), out)

    return widened
