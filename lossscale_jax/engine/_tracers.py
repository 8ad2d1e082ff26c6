"""Where a traced value came from: JAX's tracing internals, read in this one module.

The wiring check (``_wiring``) asks questions no public JAX API answers: in which ``jit``
trace is this loss being computed, and do these gradients depend on that scale? Inside a
``jit`` (and ``shard_map``, ``pmap``, ``lax.cond``/``scan`` bodies) every value is a tracer of
one trace (a *frame*); a tracer made by an operation keeps that operation (its ``parent``,
with the tracers it read), so the operations a value depends on can be walked back to the
frame's inputs. Operations of a backward pass carry ``transpose`` in their name stack (what
a profile shows as ``transpose(jvp(...))``); an operation that holds a program of its own (a
``scan``, ``while`` or ``cond``, a nested ``jit``, ``checkpoint``) is one opaque operation of
the frame.

Read here, from ``jax._src``: ``core.Tracer``, ``core.trace_ctx`` (the current trace),
``partial_eval.DynamicJaxprTracer``/``DynamicJaxprTrace`` (a ``jit`` trace, its tracers'
``parent`` equation and that equation's ``in_tracers``), ``source_info_util.Transform``.
Every JAX the package admits (0.10.2 to 0.12, pyproject.toml) has them;
tests/test_wiring.py fails if one goes missing. Where they are missing (a JAX outside that
range) :data:`AVAILABLE` is false and the wiring check sees nothing: it never changes a
step's program or its values, it only refuses wirings at trace time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

try:  # JAX's internals: present in every JAX the package admits (see the docstring)
    from jax._src import core as _core
    from jax._src import source_info_util as _source_info
    from jax._src.interpreters import partial_eval as _pe

    _Tracer: Any = _core.Tracer
    _JitTracer: Any = _pe.DynamicJaxprTracer
    _JitTrace: Any = _pe.DynamicJaxprTrace
    _Transform: Any = _source_info.Transform
    _trace_ctx: Any = _core.trace_ctx
    from lossscale_jax.engine._jaxprs import ClosedJaxpr as _ClosedJaxpr

    _PROGRAMS: tuple[type, ...] = (_core.Jaxpr, _ClosedJaxpr)
    AVAILABLE = all(
        name in getattr(_JitTracer, "__slots__", ()) for name in ("val", "parent")
    ) and hasattr(_trace_ctx, "trace")
except (ImportError, AttributeError):  # pragma: no cover - a JAX outside the admitted range
    AVAILABLE = False

# Wrappers the walk to a jit tracer looks through: a JVP or linearize tracer's primal, a
# batch tracer's value.
_INNER = ("primal", "val")
_MAX_DEPTH = 64


def jit_tracer(x: Any) -> Any | None:
    """The ``jit`` trace's tracer under ``x`` (a JVP, linearize or batch tracer's primal or
    value, looked through), or ``None`` for a concrete value or another kind of tracer."""
    if not AVAILABLE:
        return None
    for _ in range(_MAX_DEPTH):
        if isinstance(x, _JitTracer):
            return x
        if not isinstance(x, _Tracer):
            return None
        inner = next((getattr(x, a) for a in _INNER if isinstance(getattr(x, a, None), _Tracer)), x)
        if inner is x:
            return None
        x = inner
    return None


def is_tracer(x: Any) -> bool:
    """Whether ``x`` is a tracer of any kind (a value of some trace, not a concrete array)."""
    return AVAILABLE and isinstance(x, _Tracer)


def frame_of(tracer: Any) -> Any:
    """The ``jit`` trace a jit tracer belongs to."""
    return tracer._trace


def current_frame() -> Any | None:
    """The innermost ``jit`` trace of the trace now running (looking through the traces of
    ``grad``, ``vmap``, ... above it), or ``None`` outside any (eager code)."""
    if not AVAILABLE:
        return None
    trace = _trace_ctx.trace
    for _ in range(_MAX_DEPTH):
        if trace is None or isinstance(trace, _JitTrace):
            return trace
        trace = getattr(trace, "parent_trace", None)
    return None


def same_value(a: Any, b: Any) -> bool:
    """Whether two jit tracers stand for the same variable of their frame."""
    return a is b or (a.val is b.val and a._trace is b._trace)


def _transformed(eqn: Any, name: str) -> bool:
    stack = getattr(getattr(eqn.source_info, "name_stack", None), "stack", ())
    return any(isinstance(s, _Transform) and s.name == name for s in stack)


class Ancestry:
    """What a walk back from some tracers of one frame found among the operations they
    depend on: a target tracer, a backward pass's operation."""

    def __init__(self) -> None:
        self.found = False
        self.backward = False


def walk(
    roots: Iterable[Any],
    targets: Iterable[Any] = (),
    *,
    through: str | None = None,
) -> Ancestry:
    """Walks back from the jit tracers ``roots`` through the operations they depend on.

    Stops early once a tracer standing for one of ``targets`` is found. ``through``: follow
    only operations whose name stack has that transform (``"jvp"``: the forward pass of one
    differentiation), else every operation of the frame.
    """
    goal_vals = {id(t.val) for t in targets if isinstance(t, _JitTracer)}
    out = Ancestry()
    seen: set[int] = set()
    stack = [t for t in roots if isinstance(t, _JitTracer)]
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        if id(t.val) in goal_vals:
            out.found = True
            return out
        eqn = t.parent
        if eqn is None:
            continue
        if through is not None and not _transformed(eqn, through):
            continue
        if not out.backward and _transformed(eqn, "transpose"):
            out.backward = True
        stack.extend(x for x in eqn.in_tracers if isinstance(x, _JitTracer))
    return out


def _is_function(x: Any) -> bool:
    """A function an operation keeps (a custom rule, a callback), not a dtype class."""
    return callable(x) and not isinstance(x, type)


def _holds_program(eqn: Any) -> bool:
    """Whether an operation holds a program of its own (a loop, a branch, a call)."""
    for v in getattr(eqn, "params", {}).values():
        items = v if isinstance(v, tuple | list) else (v,)
        if any(isinstance(x, _PROGRAMS) or _is_function(x) for x in items):
            return True
    return False


class Carried(NamedTuple):
    """How some tracers of one frame carry one scale of it (:func:`carried`).

    Attributes:
      depth: along the path that carries it most, how many times the scale entered a backward
        pass (an operation of the backward pass read a value of the forward pass that depends
        on it: the multiplication of a cotangent by it), 2 standing for two or more.
      forward: they depend on the scale without it entering a backward pass (a value computed
        from it after the gradients were taken, such as a clipping threshold).
      opaque: an operation holding a program of its own (a loop, a nested ``jit``, a
        ``checkpoint``) read the scale: what it did with it is not seen here.
      backward: an operation of a backward pass is among what they depend on.
    """

    depth: int
    forward: bool
    opaque: bool
    backward: bool


# Per tracer: (depends on the scale, holds its magnitude, depth, opaque, backward).
_State = tuple[bool, bool, int, bool, bool]
_NOTHING: _State = (False, False, 0, False, False)
_TARGET: _State = (True, True, 0, False, False)
# Floating results that keep none of their input's magnitude.
_SIGNS = frozenset({"sign"})


def _inexact(tracer: Any) -> bool:
    dtype = getattr(getattr(tracer, "aval", None), "dtype", None)
    return dtype is not None and np.issubdtype(dtype, np.inexact)


def _combine(eqn: Any, ins: list[_State]) -> _State:
    """An operation's state from its inputs' (its outputs' magnitude: see ``_of``)."""
    depends = any(x[0] for x in ins)
    name = getattr(getattr(eqn, "primitive", None), "name", None)
    magnitude = any(x[1] for x in ins) and name not in _SIGNS
    depth = max((x[2] for x in ins), default=0)
    opaque = any(x[3] for x in ins)
    transposed = _transformed(eqn, "transpose")
    backward = transposed or any(x[4] for x in ins)
    if any(x[1] and x[2] == 0 for x in ins):  # the scale's magnitude, not yet in a backward
        if _holds_program(eqn):
            opaque = True
        elif transposed:
            depth = min(depth + 1, 2)
    return depends, magnitude, depth, opaque, backward


def _of(tracer: Any, state: _State) -> _State:
    """An output's state: a comparison's bool, an index, hold no magnitude of the scale (the
    predicate of the select a ``max`` or a ``where`` differentiates into)."""
    if state[1] and not _inexact(tracer):
        return (state[0], False, *state[2:])
    return state


def carried(roots: Iterable[Any], target: Any) -> Carried:
    """How the jit tracers ``roots`` carry the jit tracer ``target`` (a scale) of their frame.

    Every operation the roots depend on is visited once (the target's own ancestors aside).
    Rule, per tracer ``t`` made by an operation ``e`` from the tracers ``ins``::

      depends(t)   = t is target or any(depends(x) for x in ins)
      magnitude(t) = t is target or (t is floating, e is no sign, any(magnitude(x)))
      depth(t)     = max(depth(x) for x in ins)
                     + 1 if e is a backward pass's (and holds no program) and some x in
                         ins holds the scale's magnitude with depth(x) == 0  # it enters
      opaque(t)    = any(opaque(x)) or (e holds a program and some such x is in ins)
    """
    goal = id(target.val)
    by_var: dict[int, _State] = {}
    by_eqn: dict[int, _State] = {}
    roots = [t for t in roots if isinstance(t, _JitTracer)]
    for root in roots:
        stack = [root]
        while stack:
            t = stack[-1]
            key = id(t.val)
            if key in by_var:
                stack.pop()
                continue
            eqn = t.parent
            if key == goal:
                by_var[key] = _TARGET
                stack.pop()
                continue
            if eqn is None:
                by_var[key] = _NOTHING
                stack.pop()
                continue
            done = by_eqn.get(id(eqn))
            if done is None:
                ins = [x for x in eqn.in_tracers if isinstance(x, _JitTracer)]
                pending = [x for x in ins if id(x.val) not in by_var]
                if pending:
                    stack.extend(pending)
                    continue
                done = _combine(eqn, [by_var[id(x.val)] for x in ins])
                by_eqn[id(eqn)] = done
            by_var[key] = _of(t, done)
            stack.pop()
    states = [by_var[id(t.val)] for t in roots]
    return Carried(
        depth=max((x[2] for x in states), default=0),
        forward=any(x[0] and x[2] == 0 for x in states),
        opaque=any(x[3] for x in states),
        backward=any(x[4] for x in states),
    )
