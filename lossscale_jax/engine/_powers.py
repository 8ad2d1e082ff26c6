"""The power of the loss scale a traced value carries: the wiring check's analysis.

An abstract interpretation of a traced step. Against one scale ``S`` (the scale of the state
an update divides by), every floating value ``v`` of the step is described by the forms it
can take, each a sum of terms ``S**k * f`` with ``f`` free of ``S``::

  Value  = set of alternatives      # a select, a max, a branch, a loop: v is one of them
  Alt    = set of terms              # a sum: v = sum of the terms; the empty sum is zero
                                     # or not finite (nan, inf), the same at every power
  Term   = (k, mark)                 # S**k times something free of S
  mark   = 0: S never reached the term (k == 0)
           1: S reached it outside a backward pass (the forward pass, or after jax.grad)
           2: S reached it through a backward pass: a cotangent carried it
  None   = unknown: S went through a function that is not a power of it (exp, tanh, ...)

Rules, per primitive (``_rules``), for ``S > 0``::

  S itself                          {{(1, 1)}};  a step's other inputs {{(0, 0)}}
  a literal or small constant 0     {{}} (zero: the empty sum; also nan, inf, |c| >= 65504)
  add, sub, concatenate, psum, ...  the sums of one alternative of each operand
  mul, div, dot_general, conv       the products (a divisor must be one term: S**-k)
  sqrt, rsqrt, integer_pow, square  the power scaled (one term only)
  select_n, max, min, clamp, cond   the alternatives of all operands (S**k a, S**k b: S**k)
  a reduction (reduce_sum, a dot)   as its operand (a sum of elements that each take
                                    one alternative is wrong wherever every alternative
                                    is: the verdict is the same as for their mix)
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

import jax.numpy as jnp
import numpy as np

from lossscale_jax.engine._platform import IDENTITIES

Power = int | Fraction  # an int where the power is whole (most): cheap to compare
Term = tuple[Power, int]
Alt = frozenset[Term]
Value = frozenset[Alt] | None

_ZERO_ALT: Alt = frozenset()
FREE: Value = frozenset({frozenset({(0, 0)})})
ZERO: Value = frozenset({_ZERO_ALT})
SCALE: Value = frozenset({frozenset({(1, 1)})})
# Mark 3: an input of the step (an argument), summed or moved but not computed with. Its
# power is not known (an accumulator carried between steps holds scaled gradients): in a sum
# it is left out of the verdict; multiplied, or through any function, it counts as free.
IN = 3
INPUT: Value = frozenset({frozenset({(0, IN)})})
_MAYBE_ZERO: Value = frozenset({frozenset({(0, 0)}), _ZERO_ALT})
# A value with more alternatives than this, or a power past this, is unknown (a loop that
# multiplies by the scale at every turn does not reach a fixed point otherwise).
_MAX_ALTS = 12
MAX_POWER = 8
# A constant is read (to tell a zero) when it has at most this many elements; a larger one
# may be zero or not.
_SMALL = 4096
# A constant this large (float16's largest finite value) stands for an overflow.
_OVERFLOW = 65504.0


def _cap(alts: Iterable[Alt]) -> Value:
    """A value from its alternatives (``FREE`` and ``ZERO`` as themselves: the analysis
    tells them by identity), or unknown past the bounds."""
    out = frozenset(alts)
    if out == FREE:
        return FREE
    if out == ZERO:
        return ZERO
    if out == INPUT:
        return INPUT
    if len(out) > _MAX_ALTS or any(not -MAX_POWER <= k <= MAX_POWER for alt in out for k, _ in alt):
        return None
    return out


def free(v: Value) -> bool:
    """Whether a value is free of the scale (zero or not, an input or not: the scale never
    reached it)."""
    return v is FREE or (
        v is not None and all(k == 0 and m in (0, IN) for alt in v for k, m in alt)
    )


def _computed(m: int) -> int:
    """A term's mark once computed with (an input's is no longer the input's)."""
    return 0 if m == IN else m


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
            out.add(
                frozenset(
                    (kx + ky, max(_computed(mx), _computed(my))) for kx, mx in x for ky, my in y
                )
            )
    return _cap(out)


def _monomial(alt: Alt) -> Term | None:
    """An alternative whose terms all carry one power, as one term (the highest mark)."""
    powers = {k for k, _ in alt}
    if len(powers) != 1:
        return None
    return next(iter(powers)), max(_computed(m) for _, m in alt)


def power(v: Value, exponent: Power) -> Value:
    """``v ** exponent`` where every alternative carries one power (or is zero)."""
    if v is None:
        return None
    out = set()
    for alt in v:
        if not alt:  # zero, or not finite: so is any power of it (1 / 0 is inf)
            out.add(alt)
            continue
        term = _monomial(alt)
        if term is None:
            return None
        k = term[0] * exponent
        out.add(frozenset({(int(k) if k == int(k) else k, term[1])}))
    return _cap(out)


def choice(values: Sequence[Value]) -> Value:
    """One of the values (elementwise): their alternatives together."""
    out: set[Alt] = set()
    for v in values:
        if v is None:
            return None
        out |= v
    return _cap(out)


def backward(v: Value) -> Value:
    """A value an operation of a backward pass made: the scale it carries is in a cotangent."""
    if v is None or v is FREE or v is ZERO:
        return v
    return _cap(frozenset((k, 2 if (k != 0 or m in (1, 2)) else m) for k, m in alt) for alt in v)


def free_of_power(v: Value) -> Value:
    """``sign``: an alternative of one power keeps its mark, loses the power; else unknown."""
    if v is None:
        return None
    out = set()
    for alt in v:
        term = _monomial(alt) if alt else (0, 0)
        if term is None:
            return None
        out.add(frozenset({(0, term[1])}) if alt else alt)
    return _cap(out)


def _of_power_zero(ins: Sequence[Value]) -> Value:
    """A function that is no power (exp, tanh, ...) of values that carry the scale to the
    power 0 only (it reached them and cancelled): free of its size, it keeps the mark."""
    marks = set()
    for v in ins:
        if v is None or any(k != 0 for alt in v for k, _ in alt):
            return None
        marks |= {_computed(m) for alt in v for _, m in alt}
    return frozenset({frozenset({(0, max(marks, default=0))})})


def constant(value: Any) -> Value:
    """A constant of the step: zero, free of the scale, or (too large to read) either.

    A nan or inf constant counts as zero: like zero it is the same at every power of the
    scale (it is what an unscaling by a bad scale returns, which the overflow check sees). So
    does one of float16's largest magnitude or more (65504, -1e9): a saturated element, a
    saturation bound, a mask standing for -inf.
    """
    if isinstance(value, float | int):  # a Python scalar literal
        return ZERO if not abs(value) < _OVERFLOW or value == 0 else FREE
    size = getattr(value, "size", 1)
    if size is None or size > _SMALL:
        return _MAYBE_ZERO
    try:
        array = np.asarray(value)
        if np.issubdtype(array.dtype, np.inexact):
            return ZERO if np.all((array == 0) | ~(np.abs(array) < _OVERFLOW)) else FREE
        return ZERO if not np.any(array) else FREE
    except Exception:  # noqa: BLE001 - a value that cannot be read: either
        return _MAYBE_ZERO


# -- the rules ---------------------------------------------------------------------------

_LINEAR = frozenset(
    {
        "add", "add_any", "sub", "neg", "convert_element_type", "reduce_precision", "copy",
        "copy_p", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "rev",
        "slice", "concatenate", "pad", "dynamic_update_slice", "split", "real", "imag", "conj",
        "complex", "sharding_constraint", "mesh_cast", "reshard", "scatter-add", "stop_gradient",
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
_POWERS: dict[str, Power] = {
    "sqrt": Fraction(1, 2),
    "rsqrt": Fraction(-1, 2),
    "cbrt": Fraction(1, 3),
    "square": 2,
}
# Each output is its operand (moved, copied, or summed over devices).
_PER_OPERAND = frozenset(
    {"optimization_barrier", "sort", "device_put", "psum", "pmean", "psum_invariant",
     "psum2", "pmax", "pmin", "ppermute", "pbroadcast", "pvary", "pcast", "all_gather",
     "all_gather_invariant", "all_to_all", "ragged_all_to_all", "psum_scatter",
     "reduce_scatter", "preduced", "unreduced_psum", "pgather"} | IDENTITIES
)  # fmt: skip


_MOVING = frozenset(_LINEAR | _INDEXED | _REDUCING | _CHOOSING | _PER_OPERAND)
_RULED = frozenset(
    _LINEAR | _INDEXED | _REDUCING | _CHOOSING | _BILINEAR | set(_POWERS) | _PER_OPERAND
)


_INEXACT: dict[Any, bool] = {}


def inexact(aval: Any) -> bool:
    """Whether a value is floating or complex: bfloat16 and the float8s included (JAX's
    dtypes, which NumPy's ``issubdtype`` does not place under ``inexact``)."""
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return False
    found = _INEXACT.get(dtype)
    if found is None:
        try:
            found = bool(jnp.issubdtype(dtype, jnp.inexact))
        except TypeError:  # an extended dtype (a PRNG key)
            found = False
        _INEXACT[dtype] = found
    return found


def moves(name: str) -> bool:
    """Whether a primitive moves, sums or picks its operands (an input stays an input)."""
    return name in _MOVING


def has_rule(name: str) -> bool:
    """Whether a primitive has a rule here (a scatter's combiner program is not a call)."""
    return name in _RULED


def apply(name: str, params: dict[str, Any], ins: list[Value], n_out: int) -> list[Value]:
    """The outputs of one primitive (without programs) from its inputs' values."""
    if name in _PER_OPERAND and len(ins) == n_out:
        return list(ins)
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
    elif name in _BILINEAR and len(ins) == 2:
        out = mul(*ins)
    elif name == "div" and len(ins) == 2:
        out = mul(ins[0], power(ins[1], -1))
    elif name in _REDUCING:
        out = add(ins)
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
            out = power(base, -1)
    elif name == "abs":
        out = power(ins[0], 1)
    elif name == "sign":
        out = free_of_power(ins[0])
    elif all(free(v) for v in ins):
        out = FREE
    else:
        out = _of_power_zero(ins)
    return [out] * n_out
