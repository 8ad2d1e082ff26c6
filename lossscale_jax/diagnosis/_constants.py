"""Constants that the float16 program turns into inf: ``where(mask, x, -2.38e38)``.

A mask written with a constant beyond float16's range, such as float32's lowest value
(-3.4e38) or -1e9, is -inf once converted to float16; a fully masked row's softmax is then
``exp(-inf - -inf)`` = nan. ``diagnose`` looks for the pattern in the float16 program (one
trace, no computation) when its forward pass is not finite, and names it in the verdict.

The walk follows the values the program knows at trace time: literals and constants, through
``convert_element_type``, the reshaping primitives and the calls it inlines (``jnp.where`` is
a ``jit``: its constant arrives as an argument). It records a constant when a conversion to the
compute dtype makes inf of a finite value, and when an infinite constant of that dtype is one
of the cases of a ``select_n`` (``jnp.where``, ``lax.select``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jcore
import numpy as np

from lossscale_jax.engine._jaxprs import ClosedJaxpr
from lossscale_jax.taps._upcast import INLINE_CALLS

# Primitives that keep the values of their first operand (a known constant stays known).
_SAME_VALUES = {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "copy", "copy_p"}
_MAX_VALUES = 64  # distinct values tracked per constant: a larger table is no mask constant
_LIBRARIES = tuple(
    os.path.dirname(path) + os.sep for path in (jax.__file__, np.__file__) if path is not None
)


@dataclasses.dataclass(frozen=True)
class Constant:
    """A constant the float16 program holds as inf."""

    value: float  # as written (float32 or wider); inf when written as inf
    line: str  # "file.py:12" of the code that wrote it, or ""
    module: str  # the Flax module path (JAX's name stack) around it, or ""
    masking: bool  # a case of a select_n: a jnp.where


def out_of_range(fn: Callable, args: tuple, low: Any) -> list[Constant]:
    """The constants ``fn(*args)`` holds as inf in ``low``, in program order (one trace)."""
    closed = jax.make_jaxpr(fn)(*args)
    found: dict[int, dict] = {}
    try:
        _scan(closed, np.dtype(low), found)
    except Exception:  # a program this walk does not know: a hint, never diagnose's failure
        return []
    return [Constant(**f) for f in found.values()]


def _scan(closed: Any, low: np.dtype, found: dict) -> None:
    """The walk of a closed program: its constants known from the start."""
    consts = zip(closed.jaxpr.constvars, closed.consts, strict=True)
    known = {v: (vals, None) for v, c in consts if (vals := _values(c)) is not None}
    _walk(closed.jaxpr, known, low, found, "")


def _values(x: Any) -> np.ndarray | None:
    """The distinct values of a constant (``None`` when not floating, or too many)."""
    try:
        a = np.asarray(x)
    except Exception:  # a typed PRNG key, an opaque value
        return None
    if not np.issubdtype(a.dtype, np.floating) or a.size > 1_000_000:
        return None
    u = np.unique(a)
    return u if u.size <= _MAX_VALUES else None


def _walk(jaxpr: Any, known: dict, low: np.dtype, found: dict, stack: str, site: str = "") -> None:
    """Follow the known constants through ``jaxpr``'s equations, recording into ``found``
    (``stack``, ``site``: the module path and the user's line of the call ``jaxpr`` is the
    body of: a traceback inside a ``jit``'s body stops at the ``jit``)."""

    def read(v: Any) -> tuple[np.ndarray, int | None] | None:
        if isinstance(v, jcore.Literal):
            vals = _values(v.val)
            return None if vals is None else (vals, None)
        return known.get(v)

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        here = str(eqn.source_info.name_stack) or stack
        ins = [read(v) for v in eqn.invars]
        if name == "convert_element_type" and ins[0] is not None:
            vals, origin = ins[0]
            with np.errstate(over="ignore", invalid="ignore"):
                out = vals.astype(eqn.params["new_dtype"])
            if out.dtype == low and np.all(np.isfinite(vals)) and not np.all(np.isfinite(out)):
                origin = _record(found, eqn, here, site, float(vals[~np.isfinite(out)][0]))
            known[eqn.outvars[0]] = (out, origin)
        elif name in _SAME_VALUES and ins and ins[0] is not None:
            known[eqn.outvars[0]] = ins[0]
        elif name == "select_n":
            for v, got in zip(eqn.invars[1:], ins[1:], strict=True):
                if got is None or v.aval.dtype != low or np.all(np.isfinite(got[0])):
                    continue
                origin = got[1]
                if origin is None:  # an inf written as such
                    origin = _record(found, eqn, here, site, float(got[0][~np.isfinite(got[0])][0]))
                found[origin]["masking"] = True
        elif name in INLINE_CALLS and INLINE_CALLS[name] in eqn.params:
            _call(eqn, eqn.params[INLINE_CALLS[name]], ins, known, low, found, here, site)
        else:
            for sub in jcore.jaxprs_in_params(eqn.params):  # scan, cond, while: fresh values
                _walk(sub, {}, low, found, here, _user_line(eqn) or site)


def _call(
    eqn: Any, body: Any, ins: list, known: dict, low: Any, found: dict, stack: str, site: str
) -> None:
    """An inlined call: its arguments' known values in, its results' out."""
    inner = body.jaxpr if isinstance(body, ClosedJaxpr) else body
    env: dict = {}
    if isinstance(body, ClosedJaxpr):
        for v, c in zip(inner.constvars, body.consts, strict=True):
            vals = _values(c)
            if vals is not None:
                env[v] = (vals, None)
    if len(inner.invars) == len(ins):
        env.update({v: got for v, got in zip(inner.invars, ins, strict=True) if got is not None})
    _walk(inner, env, low, found, stack, _user_line(eqn) or site)
    if len(inner.outvars) == len(eqn.outvars):
        for v, out in zip(eqn.outvars, inner.outvars, strict=True):
            if not isinstance(out, jcore.Literal) and out in env:
                known[v] = env[out]


def _record(found: dict, eqn: Any, module: str, site: str, value: float) -> int:
    line = _user_line(eqn) or site
    for key, f in found.items():  # one record per line of code (a model calls it per layer)
        if f["line"] == line and line:
            return key
    key = len(found)
    found[key] = {"value": value, "line": line, "module": module, "masking": False}
    return key


def _user_line(eqn: Any) -> str:
    """The innermost frame outside JAX and NumPy of where ``eqn`` was traced."""
    try:
        frames = eqn.source_info.traceback.frames
    except AttributeError:  # no traceback kept
        return ""
    for f in frames:
        if not f.file_name.startswith(_LIBRARIES) and "/jaxlib/" not in f.file_name:
            return f"{os.path.basename(f.file_name)}:{f.line_num}"
    return ""


def advice(found: list[Constant], low: Any) -> str:
    """The verdict's sentence for the constants found (the first one named), "" for none."""
    if not found:
        return ""
    c = next((f for f in found if f.masking), found[0])
    low = np.dtype(low)
    limit = float(np.finfo(low).max)
    at = (f" at {c.line}" if c.line else "") + (f" in {c.module}" if c.module else "")
    sign = "-" if c.value < 0 else ""
    held = ("is" if np.isinf(c.value) else "becomes") + f" {sign}inf in {low.name}"
    if c.masking:
        return (
            f"a `jnp.where` (masking){at} uses the constant {c.value:.3g}, outside "
            f"{low.name}'s finite range: it {held}, and the softmax of a fully masked row is "
            f"then nan; use jnp.finfo(x.dtype).min ({-limit:.6g} in {low.name}) or a large "
            "finite negative value such as -1e4 instead"
        )
    return (
        f"the constant {c.value:.3g}{at} is outside {low.name}'s finite range (it "
        f"{held}); use a value within it (|x| <= {limit:.6g})"
    )
