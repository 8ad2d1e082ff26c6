"""Where a traced value came from: JAX's tracing internals, read in this one module.

The wiring check (``_wiring``) asks questions no public JAX API answers: in which ``jit``
trace is this loss being computed, and do these gradients depend on that scale? Inside a
``jit`` (and ``shard_map``, ``pmap``, ``lax.cond``/``scan`` bodies) every value is a tracer of
one trace (a *frame*); a tracer made by an operation keeps that operation (its ``parent``,
with the tracers it read), so the operations a value depends on can be walked back to the
frame's inputs. Operations of a backward pass carry ``transpose`` in their name stack (what
a profile shows as ``transpose(jvp(...))``).

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
from typing import Any

try:  # JAX's internals: present in every JAX the package admits (see the docstring)
    from jax._src import core as _core
    from jax._src import source_info_util as _source_info
    from jax._src.interpreters import partial_eval as _pe

    _Tracer: Any = _core.Tracer
    _JitTracer: Any = _pe.DynamicJaxprTracer
    _JitTrace: Any = _pe.DynamicJaxprTrace
    _Transform: Any = _source_info.Transform
    _trace_ctx: Any = _core.trace_ctx
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
