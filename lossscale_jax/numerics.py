"""Pure functions on gradient pytrees: overflow detection and unscaling.

Nothing here holds state. Every function is jit-able and makes no Python
decision on array values.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

OverflowMode = Literal["ieee", "saturating", "both"]
OVERFLOW_MODES: tuple[OverflowMode, ...] = ("ieee", "saturating", "both")

_FLOAT16_FAMILY = (jnp.float16,)
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


def _is_float(x: Any) -> bool:
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


# How many leaves of one shape share a reduction (see ``_leaf_flags``): enough to
# cut the kernel count of a many-layer model, few enough to keep each kernel small.
_GROUP = 16


def _predicates(g: jax.Array, mode: str, threshold: float) -> tuple[jax.Array, jax.Array]:
    """Two elementwise predicates whose union is the overflow test of ``mode``.

    ieee:        isinf(g)                    | isnan(g)
    saturating:  max <= |g| < inf            | isinf(g)      (nan is not an overflow here)
    both:        |g| >= max                  | isnan(g)

    The comparison is done in the leaf's own dtype, where the threshold is exact
    for float16/bfloat16/float32 leaves alike (65504 rounds to 65536 in
    bfloat16, which no bfloat16 value in between can tell apart); nan compares
    False. Two disjoint predicates keep the reduction of a leaf alone in its
    group variadic (see ``_leaf_flags``), neither provably redundant to XLA.
    """
    if mode == "ieee":
        return jnp.isinf(g), jnp.isnan(g)
    magnitude = jnp.abs(g)
    with np.errstate(over="ignore"):  # finfo(float32).max is inf in float16: only inf is caught
        limit = np.asarray(threshold).astype(g.dtype)
    if mode == "saturating":
        return jnp.logical_and(magnitude >= limit, jnp.isfinite(g)), jnp.isinf(g)
    return magnitude >= limit, jnp.isnan(g)


def _or(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    return tuple(jnp.logical_or(x, y) for x, y in zip(a, b, strict=True))


def _or_max(n: int) -> Any:
    """The reducer of ``n`` flags followed by ``n`` magnitudes: OR, then max."""

    def reducer(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        return _or(a[:n], b[:n]) + tuple(
            jnp.maximum(x, y) for x, y in zip(a[n:], b[n:], strict=True)
        )

    return reducer


def _magnitude(g: jax.Array) -> jax.Array:
    """``|g|`` in float32 at least (XLA:CPU reduces float32 faster than float16).

    A nan in ``g`` may or may not reach the maximum (XLA's ``max`` on nan is not
    pinned down); ``HeadroomScale`` takes a maximum that is not finite as no
    measurement, and in ``"ieee"``/``"both"`` mode a nan is an overflow anyway.
    """
    return jnp.abs(g.astype(at_least_float32(g.dtype)))


def _leaf_flags(
    leaves: list[jax.Array], mode: str, threshold: float, with_max: bool = False
) -> Any:
    """One scalar bool per leaf, from one read of each leaf and no leaf-sized temporary.

    Leaves of the same shape are checked together, ``_GROUP`` at a time, in one
    variadic ``lax.reduce`` that ORs each leaf's overflow test over all its
    dimensions and returns one flag per leaf; a leaf alone in its group
    reduces its two predicates (``_predicates``) as two outputs. Why
    variadic: XLA's TreeReductionRewriter (run by XLA:CPU) splits a
    single-output reduction over more than 32 elements into a reduce-window
    and a reduce, and the elementwise test can then no longer fuse into it,
    so the backend writes a one-byte-per-element mask and reads it back.
    Variadic reductions are left alone: the test fuses into the reduction
    (one kernel per group, one read of each gradient). A reduction over whole
    leaves needs no reshape, so a gradient in a non-default layout is read
    where it lies.

    With ``with_max`` the same reductions also return each leaf's largest
    magnitude (``_magnitude``): ``(flags, maxes)``, the maxes as float32
    scalars. Still one kernel per group (same shape and magnitude dtype, half
    as many leaves), one read per leaf.
    """
    flags: list[Any] = [None] * len(leaves)
    maxes: list[Any] = [None] * len(leaves)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, g in enumerate(leaves):
        # XLA refuses floating operands of different precisions in one reduction:
        # with the magnitudes (float32, or float64 for float64 leaves), a group is
        # also one magnitude dtype.
        key = (tuple(g.shape), at_least_float32(g.dtype)) if with_max else (tuple(g.shape),)
        groups.setdefault(key, []).append(i)
    false = jnp.zeros([], jnp.bool_)
    # Two outputs per leaf with the magnitudes: half as many leaves per kernel keeps
    # the kernel's outputs as few (XLA:CPU slows down past about 16).
    size = _GROUP // 2 if with_max else _GROUP
    for key, members in groups.items():
        dims = tuple(range(len(key[0])))
        for start in range(0, len(members), size):
            chunk = members[start : start + size]
            if with_max:
                tests = tuple(
                    jnp.logical_or(*_predicates(leaves[i], mode, threshold)) for i in chunk
                )
                mags = tuple(_magnitude(leaves[i]) for i in chunk)
                inits = (false,) * len(chunk) + tuple(jnp.zeros([], m.dtype) for m in mags)
                out = lax.reduce(tests + mags, inits, _or_max(len(chunk)), dims)
                for k, i in enumerate(chunk):
                    flags[i] = out[k]
                    maxes[i] = out[len(chunk) + k].astype(jnp.float32)
                continue
            if len(chunk) == 1:
                pair = _predicates(leaves[chunk[0]], mode, threshold)
                out = lax.reduce(pair, (false, false), _or, dims)
                flags[chunk[0]] = jnp.logical_or(out[0], out[1])
                continue
            tests = tuple(jnp.logical_or(*_predicates(leaves[i], mode, threshold)) for i in chunk)
            out = lax.reduce(tests, (false,) * len(tests), _or, dims)
            for i, flag in zip(chunk, out, strict=True):
                flags[i] = flag
    return (flags, maxes) if with_max else flags


def _threshold(compute_dtype: Any) -> float:
    return float(jnp.finfo(validate_compute_dtype(compute_dtype)).max)


def _reduce_any(flags: list[jax.Array]) -> jax.Array:
    if not flags:
        return jnp.zeros([], jnp.bool_)
    if len(flags) == 1:
        return flags[0]
    return jnp.any(jnp.stack(flags))


def overflow_flags(
    grads: Any,
    mode: OverflowMode = "ieee",
    compute_dtype: Any = jnp.float16,
) -> Any:
    """One overflow flag per leaf of ``grads``, from the pass ``check_overflow`` makes.

    Rule::

      flags[leaf] = overflow(leaf)     # the rule of check_overflow, leaf by leaf
      check_overflow(grads) == any(flags)

    Non-floating leaves (integer, bool, ``float0``) get ``False``; ``None``
    leaves are empty subtrees and stay ``None``.

    Args:
      grads: a pytree of (scaled) gradients.
      mode: ``"ieee"``, ``"saturating"`` or ``"both"``.
      compute_dtype: the dtype whose ``finfo.max`` is the saturating threshold.

    Returns:
      A pytree with the structure of ``grads`` and a scalar ``bool`` array
      at every leaf.

    Examples:
      >>> import jax.numpy as jnp
      >>> from lossscale_jax import numerics
      >>> g = {"w": jnp.array([1.0, jnp.inf], jnp.float16), "b": jnp.ones(2, jnp.float16)}
      >>> {k: bool(v) for k, v in numerics.overflow_flags(g).items()}
      {'b': False, 'w': True}
    """
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    flags, _ = _every_leaf_flags(leaves, mode, compute_dtype)
    return jax.tree_util.tree_unflatten(treedef, flags)


def _every_leaf_flags(
    leaves: list[Any], mode: Any, compute_dtype: Any, with_max: bool = False
) -> tuple[list[jax.Array], list[jax.Array]]:
    """``_leaf_flags`` over the floating leaves, ``False`` for the others.

    Returns one scalar bool per leaf of ``leaves`` and, with ``with_max``, the
    largest magnitude of each floating leaf (else an empty list).
    """
    mode = validate_overflow_mode(mode)
    threshold = _threshold(compute_dtype)
    checked = [i for i, g in enumerate(leaves) if _is_float(g)]
    found = _leaf_flags([jnp.asarray(leaves[i]) for i in checked], mode, threshold, with_max)
    flags, maxes = found if with_max else (found, [])
    out = [jnp.zeros([], jnp.bool_)] * len(leaves)
    for i, flag in zip(checked, flags, strict=True):
        out[i] = flag
    return out, maxes


def _leaf_vector(
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
    flags, maxes = _every_leaf_flags(
        jax.tree_util.tree_leaves(grads), mode, compute_dtype, with_max
    )
    vector = jnp.stack(flags) if flags else jnp.zeros([0], jnp.bool_)
    return (vector, _max_of(maxes)) if with_max else vector


def _max_of(maxes: list[jax.Array]) -> jax.Array:
    if not maxes:
        return jnp.zeros([], jnp.float32)
    return maxes[0] if len(maxes) == 1 else jnp.max(jnp.stack(maxes))


def check_overflow_and_range(
    grads: Any,
    mode: OverflowMode = "ieee",
    compute_dtype: Any = jnp.float16,
) -> tuple[jax.Array, jax.Array]:
    """``check_overflow(grads)`` and the gradients' range, from the same pass.

    Rule::

      overflow = check_overflow(grads, mode, compute_dtype)
      amax = max(|g| over every floating leaf)          # float32; a nan may show as nan

    The magnitude is taken in the same grouped reductions as the check (one
    kernel per group of same-shape leaves, one read of each gradient, no
    leaf-sized temporary). ``HeadroomScale`` reads it as a fraction of the
    range at scale 1: ``amax / (scale * finfo(compute_dtype).max)``. When
    ``overflow`` is set, ``amax`` says nothing (an inf, or a saturated 65504).

    Args:
      grads: a pytree of (scaled) gradients.
      mode: ``"ieee"``, ``"saturating"`` or ``"both"``.
      compute_dtype: the dtype whose ``finfo.max`` is the saturating threshold.

    Returns:
      ``(overflow, amax)``: a scalar bool and a scalar float32 (0 without
      floating leaves).

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale_jax as lsj
      >>> g = {"w": jnp.array([1.0, -300.0], jnp.float16), "b": jnp.array([2.0], jnp.float16)}
      >>> overflow, amax = lsj.check_overflow_and_range(g)
      >>> bool(overflow), float(amax)
      (False, 300.0)
    """
    leaves = [g for g in jax.tree_util.tree_leaves(grads) if _is_float(g)]
    flags, maxes = _every_leaf_flags(leaves, mode, compute_dtype, with_max=True)
    return _reduce_any(flags), _max_of(maxes)


def check_overflow(
    grads: Any,
    mode: OverflowMode = "ieee",
    compute_dtype: Any = jnp.float16,
) -> jax.Array:
    """Whether any floating leaf of ``grads`` overflowed.

    Rule::

      ieee:        any(not isfinite(g))                 # inf, -inf, nan
      saturating:  any(|g| >= finfo(compute_dtype).max)  # what a saturating device writes
      both:        ieee or saturating

    Non-floating leaves (integer, bool, ``float0``) carry no gradient and are
    not checked; ``None`` leaves are empty subtrees. Under ``jit`` the check is
    one read of each leaf and writes nothing of a leaf's size: the per-leaf
    flags (``overflow_flags``) come from variadic reductions, one per group of
    same-shape leaves, and this is their ``any``.

    Args:
      grads: a pytree of (scaled) gradients.
      mode: ``"ieee"``, ``"saturating"`` or ``"both"``.
      compute_dtype: the dtype the backward pass computed in; the saturating
        threshold is ``finfo(compute_dtype).max`` (65504 for float16), also
        when the gradients arrive in float32.

    Returns:
      A scalar ``bool`` array.

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale_jax as lsj
      >>> g = {"w": jnp.array([1.0, 65504.0], jnp.float16)}
      >>> bool(lsj.check_overflow(g, "ieee")), bool(lsj.check_overflow(g, "saturating"))
      (False, True)
    """
    leaves = [g for g in jax.tree_util.tree_leaves(grads) if _is_float(g)]
    return _reduce_any(_every_leaf_flags(leaves, mode, compute_dtype)[0])


def _unscaled_dtype(g: jax.Array, p: Any) -> Any:
    if p is not None and _is_float(p):
        return p.dtype
    if g.dtype in _FLOAT16_FAMILY:
        # Dividing in float16 would underflow again: the very loss the scale
        # was there to prevent.
        return jnp.float32
    return g.dtype


def at_least_float32(dtype: Any) -> np.dtype:
    """``dtype`` if it is float32 or wider, else float32 (no promotion rules involved)."""
    dtype = np.dtype(dtype)
    return dtype if dtype.itemsize >= 4 else np.dtype(np.float32)


def _unscale_leaf(g: Any, inv_scale: jax.Array, p: Any = None) -> Any:
    if not _is_float(g):
        return g
    dtype = _unscaled_dtype(g, p)
    # Multiply in float32 at least, then cast to the target dtype.
    work = at_least_float32(dtype)
    return (g.astype(work) * inv_scale.astype(work)).astype(dtype)


def _valid_scale(scale: ArrayLike) -> jax.Array:
    """``scale`` as a float32 scalar; a host value that is not finite and > 0 raises.

    A Python or NumPy value is checked here (``ValueError``). A JAX array is
    not read back to the host (that would be a host sync): its validity is
    computed on the device, see ``_inverse`` and ``_scale_is_bad``.
    """
    if not isinstance(scale, jax.Array):
        host = np.asarray(scale)
        if host.dtype == np.bool_ or not (
            np.issubdtype(host.dtype, np.floating) or np.issubdtype(host.dtype, np.integer)
        ):
            raise TypeError(f"scale must be a real number, got {scale!r}.")
        if host.shape != ():
            raise ValueError(f"scale must be a scalar, got shape {host.shape}.")
        value = float(host)
        if not (np.isfinite(value) and value > 0.0 and np.float32(value) > 0.0):
            raise ValueError(
                f"scale must be a finite number > 0, got {scale!r}: unscaling by it would "
                "return inf, nan or sign-flipped gradients."
            )
    arr = jnp.asarray(scale, jnp.float32)
    if arr.shape != ():
        raise ValueError(f"scale must be a scalar, got shape {arr.shape}.")
    return arr


def _scale_is_bad(scale: jax.Array) -> jax.Array:
    """A scalar bool: ``scale`` (float32) is not a finite number > 0."""
    return jnp.logical_not(jnp.logical_and(scale > 0.0, jnp.isfinite(scale)))


def _inverse(scale: ArrayLike) -> jax.Array:
    """``1 / scale`` in float32, or nan when ``scale`` is not finite and > 0.

    nan makes every unscaled gradient nan, which every check sees, instead of
    inf (scale 0), zeros (scale inf) or sign-flipped gradients (scale < 0).
    For a valid scale the value is exactly ``1 / scale``.
    """
    scale = _valid_scale(scale)
    return jnp.where(_scale_is_bad(scale), jnp.float32(jnp.nan), 1.0 / scale)


def unscale(grads: Any, scale: ArrayLike, params: Any = None) -> Any:
    """Divides every floating leaf of ``grads`` by ``scale``.

    Each unscaled leaf takes the dtype of its parameter when ``params`` is
    given (fp32 master weights get float32 gradients even when the gradients
    were taken in float16); without ``params``, float16 leaves come out in
    float32 and other leaves keep their dtype. The division is done in at
    least float32.

    The scale must be finite and > 0. A Python or NumPy scale that is not
    raises ``ValueError``; a JAX array is not read back to the host, and a bad
    one (0, negative, inf, nan) makes every unscaled gradient nan, so that any
    overflow check downstream sees it.

    Args:
      grads: a pytree of scaled gradients.
      scale: the loss scale (a scalar).
      params: optional pytree with the structure of ``grads``.

    Returns:
      The unscaled gradients.

    Raises:
      ValueError: if ``scale`` is a host number that is not finite and > 0, or
        not a scalar.

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale_jax as lsj
      >>> g = {"w": jnp.array([3.0], jnp.float16)}
      >>> lsj.unscale(g, 2.0**20)["w"].dtype
      dtype('float32')
    """
    inv = _inverse(scale)
    if params is None:
        return jax.tree_util.tree_map(lambda g: _unscale_leaf(g, inv), grads)
    return jax.tree_util.tree_map(lambda g, p: _unscale_leaf(g, inv, p), grads, params)


def unscale_and_check(
    grads: Any,
    scale: ArrayLike,
    *,
    params: Any = None,
    mode: OverflowMode = "ieee",
    compute_dtype: Any = jnp.float16,
) -> tuple[Any, jax.Array]:
    """Unscales ``grads`` and checks them for overflow in one pass per leaf.

    Equivalent to ``(unscale(grads, scale, params), check_overflow(grads, mode,
    compute_dtype))``: the check reads the scaled gradient, so a saturated
    65504 is caught before the division hides it. Both are elementwise on
    the same leaf, so under ``jit`` XLA is free to fuse them with the
    gradient's producer or consumer.

    A scale that is not finite and > 0 raises ``ValueError`` when it is a
    Python or NumPy number; a JAX array one counts as an overflow (the step is
    skipped in every mode) and its unscaled gradients are nan.

    Args:
      grads: a pytree of scaled gradients.
      scale: the loss scale.
      params: optional pytree of parameters (dtype targets, see ``unscale``).
      mode: ``"ieee"``, ``"saturating"`` or ``"both"``.
      compute_dtype: dtype whose ``finfo.max`` is the saturating threshold.

    Returns:
      ``(unscaled_grads, overflow)`` with ``overflow`` a scalar bool array.

    Raises:
      ValueError: if ``scale`` is a host number that is not finite and > 0.

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale_jax as lsj
      >>> g = {"w": jnp.array([2.0, 4.0], jnp.float16)}
      >>> grads, overflow = lsj.unscale_and_check(g, 4.0)
      >>> grads["w"], bool(overflow)
      (Array([0.5, 1. ], dtype=float32), False)
      >>> bool(lsj.unscale_and_check(g, jnp.float32(0.0))[1])   # a bad device scale
      True
    """
    scale = _valid_scale(scale)
    # The check's grouped reductions (one kernel per group of same-shape leaves);
    # the unscale is elementwise, so XLA fuses it with the gradient's consumer.
    found = check_overflow(grads, mode, compute_dtype)
    return unscale(grads, scale, params), jnp.logical_or(found, _scale_is_bad(scale))
