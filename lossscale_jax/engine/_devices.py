"""Every device takes the same decision: axis names, the one collective, the mapped-axis check.

``reduce_overflow`` ORs the flag over ``axis_name``; ``reduce_packed`` carries the flag,
the range and the per-leaf record in one all-reduce; ``check_mapped_axes`` refuses, at
trace time, a step under ``jax.pmap``/``jax.shard_map`` whose devices could disagree;
``cond`` is ``lax.cond`` whose branches may differ in what varies over ``shard_map`` axes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from lossscale_jax.errors import AxisError

AxisName = Hashable | Sequence[Hashable]

# The axis name jax.pmap binds when it is given none.
_PMAP_DEFAULT_AXIS = "_internal_pmap_axis_name"


def validate_axis_name(axis_name: Any, what: str = "axis_name") -> tuple[Hashable, ...] | None:
    """``axis_name`` as a tuple of names (``None`` stays ``None``); a bad one is refused."""
    if axis_name is None:
        return None
    names = tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)
    if not names:
        raise ValueError(f"{what} must be a name or a non-empty tuple of names, got ().")
    for n in names:
        if n is None or not isinstance(n, Hashable) or isinstance(n, bool):
            raise TypeError(
                f"{what} must be a hashable name or a tuple of names, got {axis_name!r}."
            )
    return names


def validate_axes(axis_name: Any, local_axes: Any) -> tuple[tuple, tuple]:
    """``(reduced, local)`` axis names, validated; the two must not overlap."""
    reduced = validate_axis_name(axis_name) or ()
    local = validate_axis_name(local_axes, "local_axes") or ()
    both = [a for a in local if a in reduced]
    if both:
        raise ValueError(
            f"local_axes and axis_name both name {both!r}: an axis is either reduced over "
            "(axis_name) or left to each device (local_axes)."
        )
    return reduced, local


def pmax(x: jax.Array, axis_name: Any) -> jax.Array:
    """``lax.pmax(x)`` over ``axis_name`` (validated); an unbound axis is an ``AxisError``.

    ``axis_name=None`` reduces over nothing: ``x`` is returned as it is.
    """
    names = validate_axis_name(axis_name)
    if names is None:
        return x
    try:
        return lax.pmax(x, names[0] if len(names) == 1 else names)
    except NameError as e:
        bound = manual_axes()
        hint = ""
        if _PMAP_DEFAULT_AXIS in bound:
            hint = (
                f" The step runs under jax.pmap without an axis name: write "
                f"jax.pmap(step, axis_name={_fmt_names(names)}) to bind it."
            )
        raise AxisError(
            f"axis_name={axis_name!r} is not bound here: run the update inside jax.pmap or "
            "jax.shard_map over that axis, or pass axis_name=None (one device, or jit over "
            f"sharded arrays, where XLA reduces the flag).{hint} JAX said: {e}"
        ) from e


def reduce_overflow(overflow: ArrayLike, axis_name: AxisName | None) -> jax.Array:
    """ORs a scalar overflow flag over the devices of ``axis_name`` (one collective).

    With ``axis_name=None`` the flag is returned as is. Must run inside
    ``pmap``/``shard_map`` (or ``vmap``) that binds ``axis_name``.

    Rule::

      if axis_name is None: return overflow
      return pmax(int32(overflow), axis_name) > 0    # one s32[] all-reduce

    Args:
      overflow: a scalar flag (bool or number; nonzero means overflow), e.g.
        ``check_overflow(local_grads)``.
      axis_name: a ``pmap``/``shard_map`` axis name, a tuple of names, or ``None``.

    Returns:
      A scalar bool array, the same on every device of ``axis_name``.

    Raises:
      AxisError: (a ``ValueError``) if ``axis_name`` is not bound where this runs.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import lossscale_jax as lsj
      >>> flags = jnp.array([False, True, False])          # one per device
      >>> jax.vmap(lambda f: lsj.reduce_overflow(f, "batch"), axis_name="batch")(flags)
      Array([ True,  True,  True], dtype=bool)
    """
    flag = jnp.asarray(overflow, jnp.bool_)
    if validate_axis_name(axis_name) is None:
        return flag
    return pmax(flag.astype(jnp.int32), axis_name) > 0


def reduce_packed(
    found: jax.Array, amax: jax.Array | None, flags: jax.Array | None, axis_name: Any
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """``(any found, max amax, any flags)`` over ``axis_name``: one all-reduce.

    Rule::

      if nothing but found:  return pmax(int32(found)) > 0           # one s32[]
      if no amax:            packed = int32([found, flags...])       # n + 1 values
      else:                  packed = float32([found, amax..., flags...])
      packed = pmax(packed, axis_name)                               # one all-reduce
      return packed[0] > 0, packed[1:1+k] (amax), packed[...] > 0 (flags)

    ``amax`` is a scalar or a vector (one per layer segment, under per-layer scaling).

    The flag is an element of its own, so an ``amax`` that is inf (an
    overflowing device) or nan (a corrupted scale) cannot stand for it.
    """
    if validate_axis_name(axis_name) is None:
        return found, amax, flags
    if amax is None and flags is None:
        return reduce_overflow(found, axis_name), None, None
    dtype = jnp.int32 if amax is None else jnp.float32
    parts = [found.astype(dtype)[None]]
    if amax is not None:
        parts.append(amax.astype(dtype).reshape(-1))
    if flags is not None:
        parts.append(flags.astype(dtype))
    out = pmax(jnp.concatenate(parts), axis_name)
    head = 1 if amax is None else 1 + amax.size
    return (
        out[0] > 0,
        None if amax is None else out[1:head].reshape(amax.shape),
        None if flags is None else out[head:] > 0,
    )


def varying_axes(x: Any) -> frozenset | None:
    """The manual axes a value (or its abstract value) varies over, if JAX says.

    ``None`` when the aval carries no such information (older JAX: ``.vma``;
    JAX 0.10: ``.manual_axis_type.varying``).
    """
    vma = getattr(x, "vma", None)
    if vma is None:
        vma = getattr(getattr(x, "manual_axis_type", None), "varying", None)
    return None if vma is None else frozenset(vma)


def manual_axes() -> tuple:
    """The mesh axes bound here by ``jax.pmap``/``jax.shard_map`` (empty elsewhere)."""
    return tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())


def tracks_varying(axis: Hashable) -> bool:
    """Whether JAX marks values varying over ``axis`` here (shard_map with check_vma)."""
    index = jax.eval_shape(lambda: lax.axis_index(axis))
    return axis in (varying_axes(index) or ())


def _fmt_names(names: tuple) -> str:
    if not names:
        return "None"
    return repr(names[0]) if len(names) == 1 else repr(names)


def check_mapped_axes(
    updates: Any, axis_names: tuple, local_axes: tuple, mode: str, where: str
) -> None:
    """Refuses, at trace time, an update that would let devices disagree on the skip.

    Rule (for every manual axis ``a`` bound here -- ``jax.pmap``, ``jax.shard_map``
    -- that is in neither ``axis_names`` nor ``local_axes``)::

      if a is jax.pmap's unnamed axis:    raise  # name it: jax.pmap(..., axis_name=...)
      if JAX does not track what varies over a (pmap, shard_map(check_vma=False)):
          raise                                # cannot tell: ask for axis_name
      elif some gradient varies over a:   raise  # the devices decide differently
      elif mode != "ieee":                raise  # already summed: +-65504 can cancel
      # else: the gradients are the same on every device, so is the decision
    """
    unreduced = [a for a in manual_axes() if a not in axis_names and a not in local_axes]
    if not unreduced:
        return
    if _PMAP_DEFAULT_AXIS in unreduced:
        wanted = _fmt_names(axis_names) if axis_names else "'batch'"
        also = "" if axis_names else f", and pass axis_name={wanted} to {where}"
        raise AxisError(
            f"{where} runs under jax.pmap without an axis name, so the overflow flag cannot be "
            f"reduced over its devices: write jax.pmap(step, axis_name={wanted}){also}, so "
            "every device takes the same skip decision."
        )
    varying: set = set()
    for leaf in jax.tree_util.tree_leaves(updates):
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.inexact):
            varying |= varying_axes(jax.typeof(leaf)) or frozenset()
    for a in unreduced:
        head = (
            f"{where} runs under the mapped axis {a!r} (jax.pmap or jax.shard_map) but "
            f"axis_name={_fmt_names(axis_names)} does not name it"
        )
        fix = (
            f"Pass axis_name={a!r} (one scalar all-reduce, so every device takes the same "
            f"decision; right also for gradients already averaged over {a!r}), or "
            f"local_axes={a!r} if each device trains its own model and must decide alone."
        )
        if not tracks_varying(a):
            raise AxisError(
                f"{head}, and JAX does not say here whether the gradients vary over it "
                "(jax.pmap, or jax.shard_map(check_vma=False)). If they do, devices take "
                "different skip decisions: their states diverge, and a collective in the "
                f"inner transformation deadlocks. {fix}"
            )
        if a in varying:
            raise AxisError(
                f"{head}, and the gradients vary over it: each device would take its own skip "
                "decision, their states would diverge, and a collective in the inner "
                f"transformation would deadlock. {fix}"
            )
        if mode != "ieee":
            raise AxisError(
                f"{head}, and the gradients are the same on every device (already reduced over "
                f"{a!r}): in overflow={mode!r} mode +65504 and -65504 from different devices "
                "can cancel in that sum, so no check can see them. Check each device's own "
                f"gradients (differentiate with respect to lax.pcast(params, {a!r}, "
                f"to='varying')), pass axis_name={a!r} and average inside the inner "
                f"transformation; or pass local_axes={a!r} to accept the averaged check."
            )


def cond(pred: jax.Array, true_fun: Any, false_fun: Any, *operands: Any) -> Any:
    """``lax.cond``, whose branches may differ in what varies over ``shard_map`` axes.

    Under ``shard_map`` each output is marked varying over the union of the axes
    either branch's output varies over (e.g. Adam's moments computed from each
    device's own gradients versus the replicated moments a skipped step keeps).
    Elsewhere (``jit``, ``pmap``, ``shard_map(check_vma=False)``) it is
    ``lax.cond`` itself: nothing is added to the step.
    """
    true_fun, false_fun = match_varying([true_fun, false_fun], *operands)
    return lax.cond(pred, true_fun, false_fun, *operands)


def match_varying(fns: list[Any], *operands: Any) -> list[Any]:
    """``fns`` (alternatives on ``operands``, as the branches of a ``lax.cond`` or
    ``platform_dependent``), each output marked varying over the union of the
    ``shard_map`` axes any of them varies over there; ``fns`` themselves where no
    axis tracks what varies."""
    if not any(tracks_varying(a) for a in manual_axes()):
        return fns
    shapes = [jax.eval_shape(f, *operands) for f in fns]

    def union(*outs: Any) -> frozenset:
        return frozenset().union(*(varying_axes(o) or frozenset() for o in outs))

    want = jax.tree_util.tree_map(union, *shapes)

    def matched(f: Any) -> Any:
        def branch(*ops: Any) -> Any:
            return jax.tree_util.tree_map(
                lambda x, axes: pcast_to(x, axes), f(*ops), want, is_leaf=lambda x: x is None
            )

        return branch

    return [matched(f) for f in fns]


def pcast_to(x: Any, axes: frozenset) -> Any:
    """``x`` made varying over the manual ``axes`` it does not vary over yet."""
    if x is None:
        return x
    have = varying_axes(jax.typeof(x)) or frozenset()
    missing = tuple(a for a in axes if a not in have)
    return lax.pcast(x, missing, to="varying") if missing else x
