"""The overflow check's kernels: one read of each gradient, one flag per leaf, no mask.

``numerics`` holds the public functions (``check_overflow``, ``overflow_flags``,
``check_overflow_and_range``); the engine calls ``leaf_vector`` here directly, for the
per-leaf record and the range in the same reductions.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lossscale_jax.engine._ops import isinf, where

OverflowMode = Literal["ieee", "saturating", "both"]
OVERFLOW_MODES: tuple[OverflowMode, ...] = ("ieee", "saturating", "both")

FLOAT16_FAMILY = (jnp.float16,)
# The dtypes a backward pass can compute in for loss scaling: their finfo.max is
# the value a saturating device writes, representable in every leaf dtype checked.
COMPUTE_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32")


def validate_overflow_mode(mode: Any) -> OverflowMode:
    """Returns ``mode`` if it names an overflow check, else raises ``ValueError``."""
    if not isinstance(mode, str) or mode not in OVERFLOW_MODES:
        raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, got {mode!r}.")
    return mode


def validate_compute_dtype(compute_dtype: Any) -> np.dtype:
    """Returns ``compute_dtype`` as a NumPy dtype if it is float16, bfloat16 or float32.

    float64 (also Python ``float``) is refused: no float16/bfloat16/float32
    gradient reaches its ``finfo.max``, so the saturating check could never
    fire. float8/float4 are refused: 65504 is not representable in them.
    """
    try:
        dtype = np.dtype(compute_dtype)
    except TypeError as e:
        raise TypeError(
            f"compute_dtype must be a floating dtype such as jnp.float16, got {compute_dtype!r}."
        ) from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"compute_dtype must be a floating dtype such as jnp.float16, got {dtype.name}."
        )
    if dtype.name not in COMPUTE_DTYPES:
        raise ValueError(
            f"compute_dtype must be one of {COMPUTE_DTYPES} (the dtype of the backward pass), "
            f"got {dtype.name}: with float64 the saturating check can never fire, and "
            "float8/float4 cannot represent finfo(float16).max."
        )
    return dtype


def is_float(x: Any) -> bool:
    if not (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)):
        return False
    if np.dtype(x.dtype).itemsize < 2:
        # float8/float4: finfo(float16).max is not representable (it becomes nan or inf),
        # so neither check would mean anything.
        raise TypeError(
            f"gradient and parameter leaves of dtype {np.dtype(x.dtype).name} are not "
            "supported: loss scaling checks and unscales float16, bfloat16, float32 and "
            "float64 leaves. Cast float8 gradients to a wider dtype before the update."
        )
    return True


# How many leaves of one shape share a reduction (see ``leaf_flags``): enough to
# cut the kernel count of a many-layer model, few enough to keep each kernel small.
GROUP = 16


def predicates(g: jax.Array, mode: str, threshold: float) -> tuple[jax.Array, jax.Array]:
    """Two elementwise predicates whose union is the overflow test of ``mode``.

    ieee:        isinf(g)                    | isnan(g)
    saturating:  max <= |g| < inf            | isinf(g)      (nan is not an overflow here)
    both:        |g| >= max                  | isnan(g)

    The comparison is done in the leaf's own dtype, where the threshold is exact
    for float16/bfloat16/float32 leaves alike (65504 rounds to 65536 in
    bfloat16, which no bfloat16 value in between can tell apart); nan compares
    False. Two disjoint predicates keep the reduction of a leaf alone in its
    group variadic (see ``leaf_flags``), neither provably redundant to XLA.
    """
    if mode == "ieee":
        return isinf(g), jnp.isnan(g)
    magnitude = jnp.abs(g)
    with np.errstate(over="ignore"):  # finfo(float32).max is inf in float16: only inf is caught
        limit = np.asarray(threshold).astype(g.dtype)
    if mode == "saturating":
        return jnp.logical_and(magnitude >= limit, jnp.isfinite(g)), isinf(g)
    return magnitude >= limit, jnp.isnan(g)


def or_(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    return tuple(jnp.logical_or(x, y) for x, y in zip(a, b, strict=True))


def or_max(n: int) -> Any:
    """The reducer of ``n`` flags followed by magnitudes: OR, then max (``n = 0``: max alone)."""

    def reducer(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        return or_(a[:n], b[:n]) + tuple(
            jnp.maximum(x, y) for x, y in zip(a[n:], b[n:], strict=True)
        )

    return reducer


def magnitude(g: jax.Array) -> jax.Array:
    """``|g|`` in float32 at least (XLA:CPU reduces float32 faster than float16).

    A nan in ``g`` may or may not reach the maximum (XLA's ``max`` on nan is not
    pinned down); ``HeadroomScale`` takes a maximum that is not finite as no
    measurement, and in ``"ieee"``/``"both"`` mode a nan is an overflow anyway.
    """
    return jnp.abs(g.astype(at_least_float32(g.dtype)))


def coded_magnitude(g: jax.Array, mode: str) -> jax.Array:
    """``|g|`` (``magnitude``) with each nan made what ``mode`` takes it for: ``inf`` where a
    nan is an overflow (``"ieee"``, ``"both"``), ``0`` where it is not (``"saturating"``).

    One reduction of it gives a leaf's overflow flag and its range at once: the flag is
    ``max >= limit`` (``limit``: ``inf`` for ``"ieee"``, else the compute dtype's largest
    value; see ``flag_of``), the range the max itself, finite on a leaf that did not overflow.
    """
    mag = magnitude(g)
    return where(jnp.isnan(g), jnp.asarray(0.0 if mode == "saturating" else np.inf, mag.dtype), mag)


def flag_of(peak: jax.Array, mode: str, threshold: float) -> jax.Array:
    """A leaf's overflow flag from the max of its ``coded_magnitude``: the test of ``predicates``
    (the threshold compared in float32 or wider is the same test as in the leaf's dtype: every
    float16 and bfloat16 value is exact there, and none lies between 65504 and its rounding)."""
    limit = np.inf if mode == "ieee" else threshold
    return peak >= jnp.asarray(limit, peak.dtype)


def _groups(leaves: list[Any], with_max: bool) -> dict[tuple[Any, ...], list[int]]:
    """The leaves' indices by what a reduction may hold together: a shape (and, with the
    magnitudes, their dtype: XLA refuses floating operands of different precisions in one
    reduction)."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, g in enumerate(leaves):
        key = (tuple(g.shape), at_least_float32(g.dtype)) if with_max else (tuple(g.shape),)
        groups.setdefault(key, []).append(i)
    return groups


def alone(leaves: list[Any]) -> set[int]:
    """The indices of the floating leaves of ``leaves`` that ``leaf_flags`` (without the
    maxima) reduces alone in their group, from their two predicates."""
    floats = [i for i, g in enumerate(leaves) if is_float(g)]
    groups = _groups([leaves[i] for i in floats], False)
    out = set()
    for members in groups.values():
        for start in range(0, len(members), GROUP):
            chunk = members[start : start + GROUP]
            if len(chunk) == 1:
                out.add(floats[chunk[0]])
    return out


def leaf_flags(
    leaves: list[jax.Array],
    mode: str,
    threshold: float,
    with_max: bool = False,
    tests: list[Any] | None = None,
) -> Any:
    """One scalar bool per leaf, from one read of each leaf and no leaf-sized temporary.

    Leaves of the same shape are checked together, ``GROUP`` at a time, in one
    variadic ``lax.reduce`` that ORs each leaf's overflow test over all its
    dimensions and returns one flag per leaf; a leaf alone in its group
    reduces its two predicates (``predicates``) as two outputs. Why
    variadic: XLA's TreeReductionRewriter (run by XLA:CPU) splits a
    single-output reduction over more than 32 elements into a reduce-window
    and a reduce, and the elementwise test can then no longer fuse into it,
    so the backend writes a one-byte-per-element mask and reads it back.
    Variadic reductions are left alone: the test fuses into the reduction
    (one kernel per group, one read of each gradient). A reduction over whole
    leaves needs no reshape, so a gradient in a non-default layout is read
    where it lies.

    With ``with_max`` the same reductions also return each leaf's largest
    magnitude (``magnitude``): ``(flags, maxes)``, the maxes as float32
    scalars. One output per leaf there, the max of its ``coded_magnitude``,
    from which the flag follows (``flag_of``): still one kernel per group of
    ``GROUP`` leaves, one read per leaf (a leaf alone in its group reduces its
    flag beside its max, two outputs, as above).

    ``tests``: without ``with_max``, each leaf's ``logical_or(*predicates(...))`` where the
    caller traced it already (``None`` where not), reduced as it is (``_check_rows`` shares
    them with the rows it lays out).
    """
    flags: list[Any] = [None] * len(leaves)
    maxes: list[Any] = [None] * len(leaves)
    groups = _groups(leaves, with_max)
    false = jnp.zeros([], jnp.bool_)
    for key, members in groups.items():
        dims = tuple(range(len(key[0])))
        for start in range(0, len(members), GROUP):
            chunk = members[start : start + GROUP]
            if with_max and len(chunk) == 1:
                (i,) = chunk
                test = jnp.logical_or(*predicates(leaves[i], mode, threshold))
                mag = coded_magnitude(leaves[i], mode)
                out = lax.reduce((test, mag), (false, jnp.zeros([], mag.dtype)), or_max(1), dims)
                flags[i], maxes[i] = out[0], out[1].astype(jnp.float32)
                continue
            if with_max:
                # One output per leaf (XLA:CPU slows down past about 16 outputs a kernel, and
                # XLA:GPU splits a kernel of more): its coded max, the flag read off it.
                mags = tuple(coded_magnitude(leaves[i], mode) for i in chunk)
                inits = tuple(jnp.zeros([], m.dtype) for m in mags)
                out = lax.reduce(mags, inits, or_max(0), dims)  # no flags: max alone
                for i, peak in zip(chunk, out, strict=True):
                    flags[i] = flag_of(peak, mode, threshold)
                    maxes[i] = peak.astype(jnp.float32)
                continue
            if len(chunk) == 1:
                pair = predicates(leaves[chunk[0]], mode, threshold)
                out = lax.reduce(pair, (false, false), or_, dims)
                flags[chunk[0]] = jnp.logical_or(out[0], out[1])
                continue
            chunk_tests = tuple(
                jnp.logical_or(*predicates(leaves[i], mode, threshold))
                if tests is None or tests[i] is None
                else tests[i]
                for i in chunk
            )
            out = lax.reduce(chunk_tests, (false,) * len(chunk_tests), or_, dims)
            for i, flag in zip(chunk, out, strict=True):
                flags[i] = flag
    return (flags, maxes) if with_max else flags


def threshold(compute_dtype: Any) -> float:
    return float(jnp.finfo(validate_compute_dtype(compute_dtype)).max)


def reduce_any(flags: list[jax.Array]) -> jax.Array:
    if not flags:
        return jnp.zeros([], jnp.bool_)
    if len(flags) == 1:
        return flags[0]
    return jnp.any(jnp.stack(flags))


def every_leaf_flags(
    leaves: list[Any], mode: Any, compute_dtype: Any, with_max: bool = False
) -> tuple[list[jax.Array], list[jax.Array]]:
    """``leaf_flags`` over the floating leaves, ``False`` for the others.

    Returns one scalar bool per leaf of ``leaves`` and, with ``with_max``, the
    largest magnitude of each floating leaf (else an empty list).
    """
    mode = validate_overflow_mode(mode)
    limit = threshold(compute_dtype)
    checked = [i for i, g in enumerate(leaves) if is_float(g)]
    found = leaf_flags([jnp.asarray(leaves[i]) for i in checked], mode, limit, with_max)
    flags, maxes = found if with_max else (found, [])
    out = [jnp.zeros([], jnp.bool_)] * len(leaves)
    for i, flag in zip(checked, flags, strict=True):
        out[i] = flag
    return out, maxes


def leaf_vector(
    grads: Any,
    mode: OverflowMode = "ieee",
    compute_dtype: Any = jnp.float16,
    with_max: bool = False,
) -> Any:
    """``overflow_flags(grads)`` as one ``bool`` vector, in ``tree_leaves(grads)`` order.

    The same grouped reductions as ``check_overflow`` (its result is
    ``any(vector)``); the vector is their scalar results stacked, a few bytes
    per leaf, and nothing of a gradient's size. What ``loss_scaling`` keeps as
    its per-leaf overflow record. With ``with_max``: ``(vector, amax)``, amax
    as ``check_overflow_and_range`` measures it, from the same reductions.
    """
    flags, maxes = every_leaf_flags(jax.tree_util.tree_leaves(grads), mode, compute_dtype, with_max)
    vector = jnp.stack(flags) if flags else jnp.zeros([0], jnp.bool_)
    return (vector, max_of(maxes)) if with_max else vector


def max_of(maxes: list[jax.Array]) -> jax.Array:
    if not maxes:
        return jnp.zeros([], jnp.float32)
    return maxes[0] if len(maxes) == 1 else jnp.max(jnp.stack(maxes))


def at_least_float32(dtype: Any) -> np.dtype:
    """``dtype`` if it is float32 or wider, else float32 (no promotion rules involved)."""
    dtype = np.dtype(dtype)
    return dtype if dtype.itemsize >= 4 else np.dtype(np.float32)
