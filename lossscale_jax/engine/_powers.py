"""The power of the loss scale a traced value carries: the wiring check's analysis.

An abstract interpretation of a traced step. Against one scale ``S`` (the scale of the state
an update divides by), every floating value ``v`` of the step is described by the forms it
can take, each a sum of terms ``S**k * f`` with ``f`` free of ``S``::

  Value  = set of alternatives      # a select, a max, a branch, a loop: v is one of them
  Alt    = set of terms              # a sum: v = sum of the terms (the empty sum is zero)
  Term   = (k, mark)                 # S**k times something free of S
  mark   = 0: S never reached the term (k == 0)
           1: S reached it outside a backward pass (the forward pass, or after jax.grad)
           2: S reached it through a backward pass: a cotangent carried it
  None   = unknown: S went through a function that is not a power of it (exp, tanh, ...)

Rules, per primitive (``_rules``), for ``S > 0``::

  S itself                          {{(1, 1)}};  a step's other inputs {{(0, 0)}}
  a literal or small constant 0     {{}} (zero: the empty sum)
  add, sub, concatenate, psum, ...  the sums of one alternative of each operand
  mul, div, dot_general, conv       the products (a divisor must be one term: S**-k)
  sqrt, rsqrt, integer_pow, square  the power scaled (one term only)
  select_n, max, min, clamp, cond   the alternatives of all operands (S**k a, S**k b: S**k)
  a reduction (reduce_sum, a dot)   an operand's alternatives, and their sum
  a comparison, an integer result   free of S
  exp, log, tanh, ...               free of S if the operand is, else unknown
  an operation of a backward pass   each term that S reached gets mark 2
  a loop, a call, a remat, a map    its program interpreted (a loop's carry to a fixed point)

What it proves: a gradient whose every alternative is ``{(1, 2)}`` (or zero) is the backward
pass of a loss multiplied by ``S`` once, with ``S`` in the cotangent from the start; one
whose alternatives are all of another power is off by that power of ``S`` at every step.
What it takes as free of ``S`` (blind spots, docs/errors.md): values that pass through an
integer or a bool (an index computed from the scale), and the inside of a primitive it has
no rule for (unknown, when it reads ``S``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from lossscale_jax.engine import _tracers

Term = tuple[Fraction, int]
Alt = frozenset[Term]
Value = frozenset[Alt] | None

_ZERO_ALT: Alt = frozenset()
FREE: Value = frozenset({frozenset({(Fraction(0), 0)})})
ZERO: Value = frozenset({_ZERO_ALT})
SCALE: Value = frozenset({frozenset({(Fraction(1), 1)})})
_MAYBE_ZERO: Value = frozenset({frozenset({(Fraction(0), 0)}), _ZERO_ALT})
# A value with more alternatives than this, or a power past this, is unknown (a loop that
# multiplies by the scale at every turn does not reach a fixed point otherwise).
_MAX_ALTS = 12
_MAX_POWER = 8
# A constant is read (to tell a zero) when it has at most this many elements; a larger one
# may be zero or not.
_SMALL = 4096


def _cap(alts: Iterable[Alt]) -> Value:
    out = frozenset(alts)
    if len(out) > _MAX_ALTS or any(abs(k) > _MAX_POWER for alt in out for k, _ in alt):
        return None
    return out


def free(v: Value) -> bool:
    """Whether a value is free of the scale (zero or not: the scale never reached it)."""
    return v is FREE or (v is not None and all(k == 0 and not m for alt in v for k, m in alt))


def add(values: Sequence[Value]) -> Value:
    """A sum of the values: one alternative of each, their terms together."""
    out: set[Alt] = {_ZERO_ALT}
    for v in values:
        if v is None:
            return None
        out = {a | b for a in out for b in v}
        if len(out) > _MAX_ALTS:
            return None
    return _cap(out)


def mul(a: Value, b: Value) -> Value:
    """A product: each alternative's terms multiplied out."""
    if a is None or b is None:
        return ZERO if (a == ZERO or b == ZERO) else None
    out = set()
    for x in a:
        for y in b:
            out.add(frozenset((kx + ky, max(mx, my)) for kx, mx in x for ky, my in y))
    return _cap(out)


def power(v: Value, exponent: Fraction) -> Value:
    """``v ** exponent`` where every alternative is one term (or zero for a positive power)."""
    if v is None:
        return None
    out = set()
    for alt in v:
        if not alt:
            if exponent <= 0:
                return None
            out.add(alt)
            continue
        if len(alt) != 1:
            return None
        ((k, m),) = alt
        out.add(frozenset({(k * exponent, m)}))
    return _cap(out)


def choice(values: Sequence[Value]) -> Value:
    """One of the values (elementwise): their alternatives together."""
    out: set[Alt] = set()
    for v in values:
        if v is None:
            return None
        out |= v
    return _cap(out)


def reduced(v: Value) -> Value:
    """A sum over elements that may each take another alternative: each alternative, and
    their sum."""
    if v is None or len(v) <= 1:
        return v
    return _cap(set(v) | {frozenset().union(*v)})


def backward(v: Value) -> Value:
    """A value an operation of a backward pass made: the scale it carries is in a cotangent."""
    if v is None or v is FREE or v is ZERO:
        return v
    return _cap(
        frozenset((k, 2 if (k != 0 or m) else 0) for k, m in alt) for alt in v
    )


def free_of_power(v: Value) -> Value:
    """``sign``: one term keeps its mark, loses its power; a sum is unknown."""
    if v is None:
        return None
    out = set()
    for alt in v:
        if len(alt) > 1:
            return None
        out.add(frozenset((Fraction(0), m) for _, m in alt))
    return _cap(out)


def constant(value: Any) -> Value:
    """A constant of the step: zero, free of the scale, or (too large to read) either."""
    size = getattr(value, "size", 1)
    if size is None or size > _SMALL:
        return _MAYBE_ZERO
    try:
        return ZERO if not np.any(np.asarray(value)) else FREE
    except Exception:  # noqa: BLE001 - a value that cannot be read: either
        return _MAYBE_ZERO


# -- the rules ---------------------------------------------------------------------------

_LINEAR = frozenset(
    {
        "add", "add_any", "sub", "neg", "convert_element_type", "reduce_precision", "copy",
        "copy_p", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "rev",
        "slice", "concatenate", "pad", "dynamic_update_slice", "split", "real", "imag", "conj",
        "complex", "sharding_constraint", "mesh_cast", "reshard", "scatter-add",
        "scatter_add", "scatter", "core_call",
    }
)  # fmt: skip
# Their first operand carries the value; the rest are indices (or what selects).
_INDEXED = frozenset(
    {"dynamic_slice", "gather", "top_k", "approx_top_k", "cumsum", "cummax", "cummin",
     "select_and_scatter_add", "select_and_gather_add", "reduce_window_sum",
     "reduce_window_max", "reduce_window_min"}
)  # fmt: skip
_REDUCING = frozenset({"reduce_sum", "cumsum", "reduce_window_sum", "select_and_scatter_add"})
_CHOOSING = frozenset(
    {"select_n", "max", "min", "clamp", "reduce_max", "reduce_min", "cummax", "cummin",
     "reduce_window_max", "reduce_window_min"}
)  # fmt: skip
_BILINEAR = frozenset(
    {"mul", "dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"}
)
_POWERS: dict[str, Fraction] = {
    "sqrt": Fraction(1, 2),
    "rsqrt": Fraction(-1, 2),
    "cbrt": Fraction(1, 3),
    "square": Fraction(2),
}
# Each output is its operand (moved, copied, or summed over devices: ``_SUMMING``).
_PER_OPERAND = frozenset(
    {"optimization_barrier", "sort", "device_put", "psum", "pmean", "psum_invariant",
     "psum2", "pmax", "pmin", "ppermute", "pbroadcast", "pvary", "pcast", "all_gather",
     "all_gather_invariant", "all_to_all", "ragged_all_to_all", "psum_scatter",
     "reduce_scatter", "preduced", "unreduced_psum", "pgather"}
)  # fmt: skip
_SUMMING = frozenset(
    {"psum", "pmean", "psum_invariant", "psum2", "psum_scatter", "reduce_scatter",
     "unreduced_psum"}
)  # fmt: skip


def _inexact(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    try:
        return dtype is not None and np.issubdtype(dtype, np.inexact)
    except TypeError:  # an extended dtype (a PRNG key)
        return False


def _apply(name: str, params: dict[str, Any], ins: list[Value], n_out: int) -> list[Value]:
    """The outputs of one primitive (without programs) from its inputs' values."""
    if name in _PER_OPERAND and len(ins) == n_out:
        return [reduced(v) for v in ins] if name in _SUMMING else list(ins)
    if name in _INDEXED:
        ins = ins[:1]
    elif name in ("pad", "dynamic_update_slice"):
        ins = ins[:2]
    elif name in ("scatter-add", "scatter_add", "scatter"):
        ins = [ins[0], ins[-1]]
    elif name in _BILINEAR:
        ins = ins[:2]
    if name in _CHOOSING:
        if name == "select_n":
            ins = ins[1:]
        out = choice(ins)
    elif name in _LINEAR or name in _INDEXED:
        out = add(ins)
        if name in _REDUCING:
            out = reduced(out)
    elif name in _BILINEAR and len(ins) == 2:
        a, b = ins
        if name != "mul":
            a, b = reduced(a), reduced(b)
        out = mul(a, b)
    elif name == "div" and len(ins) == 2:
        out = mul(ins[0], power(ins[1], Fraction(-1)))
    elif name in _REDUCING:
        out = reduced(add(ins))
    elif name in _POWERS:
        out = mul(ins[0], ins[0]) if name == "square" else power(ins[0], _POWERS[name])
    elif name == "integer_pow":
        y = int(params.get("y", 1))
        out = ins[0] if y > 0 else FREE
        if y > 1:
            for _ in range(y - 1):
                out = mul(out, ins[0])
        elif y < 0:
            base = ins[0]
            for _ in range(-y - 1):
                base = mul(base, ins[0])
            out = power(base, Fraction(-1))
    elif name == "abs":
        out = power(ins[0], Fraction(1))
    elif name == "sign":
        out = free_of_power(ins[0])
    elif all(free(v) for v in ins):
        out = FREE
    else:
        out = None
    return [out] * n_out


class Powers:
    """The analysis of one frame against one scale, its results kept for later questions.

    ``value(tracer)`` is the ``Value`` of a jit tracer of the frame; ``backward(tracer)``
    whether an operation of a backward pass is among those it depends on.
    """

    def __init__(self, target: Any) -> None:
        self.goal = _tracers.variable(target)
        self.values: dict[Any, tuple[Value, bool]] = {}  # a frame's variable -> value, bwd
        self.programs: dict[tuple[int, tuple[Value, ...], bool], tuple[list[Value], bool]] = {}
        self.kept: list[Any] = []  # the programs keyed by id, kept alive

    # -- a frame: walked back from the roots through the tracers' operations --------------

    def value(self, tracer: Any) -> Value:
        return self._state(tracer)[0]

    def backward(self, tracer: Any) -> bool:
        return self._state(tracer)[1]

    def _state(self, root: Any) -> tuple[Value, bool]:
        values = self.values
        key = _tracers.variable(root)
        if key is None:
            return self._leaf(root), False
        if key in values:
            return values[key]
        stack = [root]
        while stack:
            t = stack[-1]
            key = _tracers.variable(t)
            if key in values:
                stack.pop()
                continue
            if key is self.goal:
                values[key] = (SCALE, False)
                stack.pop()
                continue
            eqn = _tracers.producer(t)
            if eqn is None:
                values[key] = (self._leaf(t), False)
                stack.pop()
                continue
            ins = _tracers.inputs(eqn)
            pending = [x for x in ins if (k := _tracers.variable(x)) is not None and k not in values]
            if pending:
                stack.extend(pending)
                continue
            states = [self._state(x) if _tracers.variable(x) is None else values[_tracers.variable(x)] for x in ins]
            outs, bwd = self._eqn(eqn, [s[0] for s in states], _tracers.transposed(eqn))
            bwd = bwd or any(s[1] for s in states)
            for var, out in zip(eqn.outvars, outs, strict=False):
                values[var] = (out, bwd)
            if key not in values:  # pragma: no cover - a tracer that is no output of its eqn
                values[key] = (None, bwd)
            stack.pop()
        return values[_tracers.variable(root)]

    @staticmethod
    def _leaf(tracer: Any) -> Value:
        """An input of the frame, a literal, or a constant of it."""
        known, value = _tracers.known_value(tracer)
        if not _inexact(getattr(tracer, "aval", None)):
            return FREE
        return constant(value) if known else FREE

    # -- one operation, and the programs it holds ----------------------------------------

    def _eqn(self, eqn: Any, ins: list[Value], transposed: bool) -> tuple[list[Value], bool]:
        n_out = len(eqn.outvars)
        name = eqn.primitive.name
        programs = _tracers.programs(eqn)
        inner_bwd = False
        if programs:
            outs, inner_bwd = self._call(name, eqn.params, programs, ins, n_out, transposed)
        elif all(v is FREE for v in ins):
            outs = [FREE] * n_out
        else:
            outs = _apply(name, eqn.params, ins, n_out)
        outs = [v if _inexact(var.aval) else FREE for v, var in zip(outs, eqn.outvars, strict=False)]
        if transposed:
            outs = [backward(v) for v in outs]
        return outs, transposed or inner_bwd

    def _call(
        self,
        name: str,
        params: dict[str, Any],
        programs: list[Any],
        ins: list[Value],
        n_out: int,
        transposed: bool,
    ) -> tuple[list[Value], bool]:
        """The outputs of an operation holding programs: each interpreted."""
        if name == "cond":
            branches = [self._run(p, ins[1:], transposed) for p in programs]
            outs = [choice([b[0][i] for b in branches]) for i in range(n_out)]
            return outs, any(b[1] for b in branches)
        if name == "scan":
            return self._scan(params, programs[0], ins, n_out, transposed)
        if name == "while":
            return self._while(params, ins, transposed)
        program = next(
            (p for p in programs if len(_tracers.open_jaxpr(p).invars) == len(ins)), None
        )
        if program is None or len(_tracers.open_jaxpr(program).outvars) != n_out:
            # a program the rule cannot line up with the operation's operands
            return [FREE if all(free(v) for v in ins) else None] * n_out, False
        return self._run(program, ins, transposed)

    def _scan(
        self, params: dict[str, Any], body: Any, ins: list[Value], n_out: int, transposed: bool
    ) -> tuple[list[Value], bool]:
        consts = int(params.get("num_consts", 0))
        carries = int(params.get("num_carry", 0))
        fixed, xs = ins[:consts], ins[consts + carries :]
        carry = list(ins[consts : consts + carries])
        outs, bwd = self._run(body, fixed + carry + xs, transposed)
        for _ in range(_MAX_POWER):
            joined = [choice([c, o]) for c, o in zip(carry, outs[:carries], strict=False)]
            if joined == carry:
                break
            carry = joined
            outs, bwd = self._run(body, fixed + carry + xs, transposed)
        else:
            carry = [None] * carries
            outs = [None] * n_out
        return carry + [reduced(v) for v in outs[carries:]], bwd

    def _while(
        self, params: dict[str, Any], ins: list[Value], transposed: bool
    ) -> tuple[list[Value], bool]:
        body = params["body_jaxpr"]
        cond_n = int(params.get("cond_nconsts", 0))
        body_n = int(params.get("body_nconsts", 0))
        fixed = ins[cond_n : cond_n + body_n]
        carry = list(ins[cond_n + body_n :])
        bwd = False
        for _ in range(_MAX_POWER):
            outs, bwd = self._run(body, fixed + carry, transposed)
            joined = [choice([c, o]) for c, o in zip(carry, outs, strict=False)]
            if joined == carry:
                return carry, bwd
            carry = joined
        return [None] * len(carry), bwd

    def _run(self, program: Any, ins: list[Value], transposed: bool) -> tuple[list[Value], bool]:
        """Interprets a program (a jaxpr) from its inputs' values."""
        key = (id(program), tuple(ins), transposed)
        done = self.programs.get(key)
        if done is not None:
            return done
        self.kept.append(program)
        jaxpr = _tracers.open_jaxpr(program)
        env: dict[Any, Value] = {}
        for var, value in zip(_tracers.constvars(program), _tracers.consts(program), strict=False):
            env[var] = constant(value) if _inexact(var.aval) else FREE
        for var, value in zip(jaxpr.invars, ins, strict=False):
            env[var] = value

        def read(atom: Any) -> Value:
            if _tracers.is_literal(atom):
                return constant(atom.val) if _inexact(atom.aval) else FREE
            return env.get(atom, FREE)

        bwd = False
        for eqn in jaxpr.eqns:
            inner = transposed and not _tracers.rematted(eqn)
            outs, e_bwd = self._eqn(eqn, [read(a) for a in eqn.invars], inner or _tracers.transposed(eqn))
            bwd = bwd or e_bwd
            for var, out in zip(eqn.outvars, outs, strict=False):
                env[var] = out
        result = ([read(a) for a in jaxpr.outvars], bwd)
        self.programs[key] = result
        return result
