"""Where a traced value came from: JAX's tracing internals, read in this one module.

The wiring check (``_wiring``) asks questions no public JAX API answers: in which ``jit``
trace is this loss being computed, and do these gradients depend on that scale? Inside a
``jit`` (and ``shard_map``, ``pmap``, ``lax.cond``/``scan`` bodies) every value is a tracer of
one trace (a *frame*); a tracer made by an operation keeps that operation (its ``parent``,
with the tracers it read), so the operations a value depends on can be walked back to the
frame's inputs. Operations of a backward pass carry ``transpose`` in their name stack (what
a profile shows as ``transpose(jvp(...))``); an operation that holds a program of its own (a
``scan``, ``while`` or ``cond``, a nested ``jit``, ``checkpoint``) holds it as a jaxpr, which
``_interpret`` reads through.

Read here, from ``jax._src``: ``core.Tracer``, ``core.trace_ctx`` (the current trace),
``partial_eval.DynamicJaxprTracer``/``DynamicJaxprTrace`` (a ``jit`` trace, its tracers'
``parent`` equation, a ``TracingEqn`` with its ``in_tracers`` and ``outvars``, and the
frame's ``constvar_to_val``: the arrays a traced function closed over), ``core.Literal``,
``source_info_util.Transform`` and ``user_context`` (to replay an equation under its name
stack). Every JAX the package admits (0.10.2 to 0.12, pyproject.toml) has them;
tests/test_wiring.py fails if one goes missing. Where they are missing (a JAX outside that
range) :data:`AVAILABLE` is false and the wiring check sees nothing: it never changes a
step's program or its values, it only refuses wirings at trace time.
"""

from __future__ import annotations

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
    _Literal: Any = _core.Literal
    _Jaxpr: Any = _core.Jaxpr
    _current_name_stack: Any = _source_info.current_name_stack
    _user_context: Any = _source_info.user_context
    from lossscale_jax.engine._jaxprs import ClosedJaxpr as _ClosedJaxpr

    _PROGRAMS: tuple[type, ...] = (_Jaxpr, _ClosedJaxpr)
    _EQN_FIELDS = ("in_tracers", "outvars", "primitive", "params", "source_info")
    AVAILABLE = (
        all(name in getattr(_JitTracer, "__slots__", ()) for name in ("val", "parent"))
        and all(name in getattr(_pe.TracingEqn, "__slots__", ()) for name in _EQN_FIELDS)
        and hasattr(_trace_ctx, "trace")
    )
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


def transposed(eqn: Any) -> bool:
    """Whether an operation (of a frame or of a jaxpr) belongs to a backward pass: its name
    stack has ``transpose``, as a profile shows ``transpose(jvp(...))``."""
    return _transformed(eqn, "transpose")


def rematted(eqn: Any) -> bool:
    """Whether an operation of a rematerialised program recomputes the forward pass (its
    name stack has the scope ``rematted_computation``): not the backward pass around it."""
    stack = getattr(getattr(eqn.source_info, "name_stack", None), "stack", ())
    return any(getattr(s, "name", None) == "rematted_computation" for s in stack)


def replaying(eqn: Any) -> Any:
    """A context to bind an equation's primitive again (an interpreter of a jaxpr) with the
    equation's name stack, as ``jax.core.eval_jaxpr`` does: the backward pass stays marked
    ``transpose`` where the check reads it."""
    stack = _current_name_stack() + eqn.source_info.name_stack
    return _user_context(eqn.source_info.traceback, name_stack=stack)


def variable(tracer: Any) -> Any | None:
    """The variable of the frame a jit tracer stands for (``None`` for a literal)."""
    val = tracer.val
    return None if isinstance(val, _Literal) else val


def producer(tracer: Any) -> Any | None:
    """The operation of the frame that made a jit tracer (``None``: an input, a literal or a
    constant of the frame). It has ``primitive``, ``params``, ``outvars`` and
    ``source_info`` as a jaxpr's equation has."""
    return tracer.parent


def inputs(eqn: Any) -> list[Any]:
    """The jit tracers an operation of the frame read, in its operands' order."""
    return list(eqn.in_tracers)


def known_value(tracer: Any) -> tuple[bool, Any]:
    """``(True, value)`` for a literal or a constant of the frame (an array the traced
    function closed over), else ``(False, None)``."""
    val = tracer.val
    if is_literal(val):
        return True, val.val
    consts = getattr(getattr(tracer._trace, "frame", None), "constvar_to_val", None)
    if isinstance(consts, dict) and val in consts:
        return True, consts[val]
    return False, None


def is_literal(atom: Any) -> bool:
    """Whether an operand of a jaxpr's equation is a literal (not a variable)."""
    return isinstance(atom, _Literal)


def programs(eqn: Any) -> list[Any]:
    """The programs (jaxprs) an operation holds: a loop's body, a call's, a branch's."""
    out: list[Any] = []
    for v in getattr(eqn, "params", {}).values():
        items = v if isinstance(v, tuple | list) else (v,)
        out.extend(x for x in items if isinstance(x, _PROGRAMS))
    return out


def open_jaxpr(program: Any) -> Any:
    """The jaxpr of a program (a closed jaxpr's, or the jaxpr itself)."""
    inner = getattr(program, "jaxpr", program)
    return inner if isinstance(inner, _Jaxpr) else program


def constvars(program: Any) -> list[Any]:
    return list(getattr(open_jaxpr(program), "constvars", ()))


def consts(program: Any) -> list[Any]:
    return list(getattr(program, "consts", ()) or ())
