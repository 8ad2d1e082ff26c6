"""The Optax transformation and the functions that read its state."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.typing import ArrayLike

from lossscale_jax import numerics, stuck
from lossscale_jax.policies import LossScalePolicy, LossScaleState

AxisName = Hashable | Sequence[Hashable]

# The attribute that marks the ``update`` of this library's transformations, so
# that one cannot be wrapped in another (that would unscale twice).
_KIND = "lossscale_jax_kind"
_PARTS = "loss_scaling_parts"  # read by apply_gradients (fused.py) and flax_utils


class LossScalingState(NamedTuple):
    """State of :func:`loss_scaling`: the loss-scale state, the inner state, the overflow record.

    Attributes:
      loss_scale: the ``LossScaleState`` (scale, counters, telemetry).
      inner_state: the state of the inner transformation.
      leaf_overflow: ``bool[n]``, one flag per leaf of the parameters given to
        ``init`` (in ``jax.tree_util.tree_leaves`` order): whether that leaf's
        scaled gradient overflowed at the last step (see ``attribution`` of
        ``loss_scaling``; ``overflowed_leaves`` names them). ``None`` when the
        transformation keeps no record (``attribution=None``).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> params = {"a": jnp.ones(2), "b": jnp.ones(3)}
      >>> tx = lsj.loss_scaling(optax.adam(1e-3), lsj.DynamicScale(init_scale=8.0))
      >>> state = tx.init(params)
      >>> type(state).__name__, float(state.loss_scale.scale), state.leaf_overflow.tolist()
      ('LossScalingState', 8.0, [False, False])
      >>> _, state = tx.update({"a": jnp.ones(2), "b": jnp.full(3, jnp.inf)}, state, params)
      >>> state.leaf_overflow.tolist(), int(state.inner_state[0].count)   # inner state untouched
      ([False, True], 0)
    """

    loss_scale: LossScaleState
    inner_state: optax.OptState
    leaf_overflow: jax.Array | None = None


class _LossScalingParts(NamedTuple):
    """The pieces of one ``loss_scaling`` update, for the fused step.

    ``inner`` is the wrapped transformation (with extra-args support);
    ``decide(scaled_grads, loss_scale, leaf_overflow) -> (loss_scale, apply,
    leaf_overflow)`` checks the scaled gradients, reduces the flag (and the
    per-leaf record, when asked) across devices, adjusts the scale and
    returns the new record (``None`` stays ``None``).
    """

    inner: optax.GradientTransformationExtraArgs
    decide: Any


def _validate_axis_name(axis_name: Any, what: str = "axis_name") -> tuple[Hashable, ...] | None:
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


ATTRIBUTIONS: tuple[str | None, ...] = ("reduced", "local", None)


def validate_attribution(attribution: Any) -> str | None:
    """Returns ``attribution`` if it names a per-leaf record, else raises ``ValueError``."""
    if attribution is not None and (
        not isinstance(attribution, str) or attribution not in ATTRIBUTIONS
    ):
        raise ValueError(f"attribution must be one of {ATTRIBUTIONS}, got {attribution!r}.")
    return attribution


def _empty_record(params: Any, attribution: str | None) -> jax.Array | None:
    """The per-leaf overflow record of a fresh state: one ``False`` per leaf of ``params``."""
    if attribution is None:
        return None
    return jnp.zeros([len(jax.tree_util.tree_leaves(params))], jnp.bool_)


def _check_and_reduce(
    updates: Any,
    scale: jax.Array,
    record: jax.Array | None,
    mode: numerics.OverflowMode,
    compute_dtype: Any,
    axis_name: Any,
    attribution: str | None,
    *,
    window: tuple[jax.Array, jax.Array] | None = None,
    with_range: bool = False,
    window_range: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """The overflow flag, the new per-leaf record and the range, reduced over ``axis_name``.

    Rule::

      flags = overflow_flags(updates) as a vector     # the check's own per-leaf results
      found = any(flags) or scale is not finite and > 0
      if with_range:                                  # from the same reductions
          amax = max |updates| / (scale * finfo(compute_dtype).max)   # float32
      if window (accumulation): found |= window_overflow
                                flags  = flags if first micro-batch else record | flags
                                amax   = amax if first micro-batch else max(window_range, amax)
      if with_range:
          found, amax, flags = (any, max, any) over axis_name   # one float32 all-reduce
      elif attribution == "reduced":
          found, flags = any over axis_name of (found, flags)  # one all-reduce, n+1 ints
      else:
          found = any over axis_name of found                 # one scalar all-reduce
      return found, (flags if record is not None else None), (amax if with_range else None)

    The flags and the range come from the reductions ``check_overflow`` makes
    (one read of each gradient, no mask); stacking them adds a few bytes per
    leaf. The flags travel in the all-reduce only for ``attribution="reduced"``.
    """
    amax = None
    if with_range:
        flags, raw = numerics._leaf_vector(updates, mode, compute_dtype, with_max=True)
        limit = jnp.float32(numerics._threshold(compute_dtype))
        amax = raw / (scale.astype(jnp.float32) * limit)
    else:
        flags = numerics._leaf_vector(updates, mode, compute_dtype)
    found = jnp.logical_or(jnp.any(flags), numerics._scale_is_bad(scale))
    if record is not None and record.shape != flags.shape:
        raise ValueError(
            f"the gradients have {flags.shape[0]} leaves but the optimizer state's "
            f"per-leaf overflow record (leaf_overflow) has {record.shape[0]}: tx.init was "
            "given parameters of another structure. Pass gradients with the structure of "
            "the parameters given to tx.init."
        )
    if window is not None:
        window_overflow, first = window
        found = jnp.logical_or(found, window_overflow)
        if record is not None:
            flags = jnp.where(first, flags, jnp.logical_or(record, flags))
        if amax is not None and window_range is not None:
            amax = jnp.where(first, amax, jnp.maximum(window_range, amax))
    reduce_flags = record is not None and attribution == "reduced" and axis_name is not None
    if amax is not None:
        found, amax, reduced = _reduce_packed(
            found, amax, flags if reduce_flags else None, axis_name
        )
        if reduce_flags:
            flags = reduced
        return found, (None if record is None else flags), amax
    if not reduce_flags:
        found = reduce_overflow(found, axis_name)
        return found, (None if record is None else flags), None
    # One collective for the flag and the record together.
    both = reduce_overflow(jnp.concatenate([found[None], flags]), axis_name)
    return both[0], both[1:], None


def _adjust(
    policy: LossScalePolicy, loss_scale: LossScaleState, found: jax.Array, amax: Any
) -> LossScaleState:
    """``policy.adjust``, given the measured range when the policy takes it."""
    if policy.measures_range:
        # The policy's adjust takes ``amax=`` (HeadroomScale's signature; the base's has none).
        adjust: Any = policy.adjust
        return adjust(loss_scale, found, amax=amax)
    return policy.adjust(loss_scale, found)


def _reduce_packed(
    found: jax.Array, amax: jax.Array, flags: jax.Array | None, axis_name: Any
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """``(any found, max amax, any flags)`` over ``axis_name``: one float32 ``pmax``.

    Rule::

      packed = [float32(found), amax, float32(flags)...]    # 2 + n values
      packed = pmax(packed, axis_name)                     # one all-reduce
      return packed[0] > 0, packed[1], packed[2:] > 0

    The flag is an element of its own, so an ``amax`` that is inf (an
    overflowing device) or nan (a corrupted scale) cannot stand for it.
    """
    names = _validate_axis_name(axis_name)
    if names is None:
        return found, amax, flags
    parts = [found.astype(jnp.float32)[None], amax.astype(jnp.float32)[None]]
    if flags is not None:
        parts.append(flags.astype(jnp.float32))
    out = _pmax(jnp.concatenate(parts), names, axis_name)
    return out[0] > 0, out[1], (None if flags is None else out[2:] > 0)


def _pmax(x: jax.Array, names: tuple, axis_name: Any) -> jax.Array:
    """``lax.pmax(x)`` over the validated ``names``; an unbound axis is a ValueError."""
    try:
        return lax.pmax(x, names[0] if len(names) == 1 else names)
    except NameError as e:
        raise ValueError(
            f"axis_name={axis_name!r} is not bound here: run the update inside jax.pmap or "
            "jax.shard_map over that axis, or pass axis_name=None (one device, or jit over "
            f"sharded arrays, where XLA reduces the flag). JAX said: {e}"
        ) from e


def _validate_axes(axis_name: Any, local_axes: Any) -> tuple[tuple, tuple]:
    """``(reduced, local)`` axis names, validated; the two must not overlap."""
    reduced = _validate_axis_name(axis_name) or ()
    local = _validate_axis_name(local_axes, "local_axes") or ()
    both = [a for a in local if a in reduced]
    if both:
        raise ValueError(
            f"local_axes and axis_name both name {both!r}: an axis is either reduced over "
            "(axis_name) or left to each device (local_axes)."
        )
    return reduced, local


def _varying_axes(x: Any) -> frozenset | None:
    """The manual axes a value (or its abstract value) varies over, if JAX says.

    ``None`` when the aval carries no such information (older JAX: ``.vma``;
    JAX 0.10: ``.manual_axis_type.varying``).
    """
    vma = getattr(x, "vma", None)
    if vma is None:
        vma = getattr(getattr(x, "manual_axis_type", None), "varying", None)
    return None if vma is None else frozenset(vma)


def _manual_axes() -> tuple:
    """The mesh axes bound here by ``jax.pmap``/``jax.shard_map`` (empty elsewhere)."""
    return tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())


def _tracks_varying(axis: Hashable) -> bool:
    """Whether JAX marks values varying over ``axis`` here (shard_map with check_vma)."""
    index = jax.eval_shape(lambda: lax.axis_index(axis))
    return axis in (_varying_axes(index) or ())


def _check_mapped_axes(
    updates: Any, axis_names: tuple, local_axes: tuple, mode: str, where: str
) -> None:
    """Refuses, at trace time, an update that would let devices disagree on the skip.

    Rule (for every manual axis ``a`` bound here -- ``jax.pmap``, ``jax.shard_map``
    -- that is in neither ``axis_names`` nor ``local_axes``)::

      if JAX does not track what varies over a (pmap, shard_map(check_vma=False)):
          raise                                # cannot tell: ask for axis_name
      elif some gradient varies over a:   raise  # the devices decide differently
      elif mode != "ieee":                raise  # already summed: +-65504 can cancel
      # else: the gradients are the same on every device, so is the decision
    """
    unreduced = [a for a in _manual_axes() if a not in axis_names and a not in local_axes]
    if not unreduced:
        return
    varying: set = set()
    for leaf in jax.tree_util.tree_leaves(updates):
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.inexact):
            varying |= _varying_axes(jax.typeof(leaf)) or frozenset()
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
        if not _tracks_varying(a):
            raise ValueError(
                f"{head}, and JAX does not say here whether the gradients vary over it "
                "(jax.pmap, or jax.shard_map(check_vma=False)). If they do, devices take "
                "different skip decisions: their states diverge, and a collective in the "
                f"inner transformation deadlocks. {fix}"
            )
        if a in varying:
            raise ValueError(
                f"{head}, and the gradients vary over it: each device would take its own skip "
                "decision, their states would diverge, and a collective in the inner "
                f"transformation would deadlock. {fix}"
            )
        if mode != "ieee":
            raise ValueError(
                f"{head}, and the gradients are the same on every device (already reduced over "
                f"{a!r}): in overflow={mode!r} mode +65504 and -65504 from different devices "
                "can cancel in that sum, so no check can see them. Check each device's own "
                f"gradients (differentiate with respect to lax.pcast(params, {a!r}, "
                f"to='varying')), pass axis_name={a!r} and average inside the inner "
                f"transformation; or pass local_axes={a!r} to accept the averaged check."
            )


def _fmt_names(names: tuple) -> str:
    if not names:
        return "None"
    return repr(names[0]) if len(names) == 1 else repr(names)


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
      ValueError: if ``axis_name`` is not bound where this runs.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import lossscale_jax as lsj
      >>> flags = jnp.array([False, True, False])          # one per device
      >>> jax.vmap(lambda f: lsj.reduce_overflow(f, "batch"), axis_name="batch")(flags)
      Array([ True,  True,  True], dtype=bool)
    """
    flag = jnp.asarray(overflow, jnp.bool_)
    names = _validate_axis_name(axis_name)
    if names is None:
        return flag
    return _pmax(flag.astype(jnp.int32), names, axis_name) > 0


def _skip_updates(shapes: Any) -> Any:
    """The updates of a skipped step: ``-0.0`` for floating leaves, 0 for others.

    ``p + -0.0`` is ``p`` bit for bit for every ``p`` (``-0.0`` included), where
    ``p + 0.0`` turns ``-0.0`` into ``+0.0``. A constant either way: free.
    """

    def leaf(s: Any) -> jax.Array:
        if jnp.issubdtype(s.dtype, jnp.inexact):
            return jnp.full(s.shape, -0.0, s.dtype)
        return jnp.zeros(s.shape, s.dtype)

    return jax.tree_util.tree_map(leaf, shapes)


def _cond(pred: jax.Array, true_fun: Any, false_fun: Any, *operands: Any) -> Any:
    """``lax.cond``, whose branches may differ in what varies over ``shard_map`` axes.

    Under ``shard_map`` each output is marked varying over the union of the axes
    either branch's output varies over (e.g. Adam's moments computed from each
    device's own gradients versus the replicated moments a skipped step keeps).
    Elsewhere (``jit``, ``pmap``, ``shard_map(check_vma=False)``) it is
    ``lax.cond`` itself: nothing is added to the step.
    """
    if not any(_tracks_varying(a) for a in _manual_axes()):
        return lax.cond(pred, true_fun, false_fun, *operands)
    shapes = [jax.eval_shape(f, *operands) for f in (true_fun, false_fun)]

    def union(a: Any, b: Any) -> frozenset:
        return (_varying_axes(a) or frozenset()) | (_varying_axes(b) or frozenset())

    want = jax.tree_util.tree_map(union, *shapes)

    def matched(f: Any) -> Any:
        def branch(*ops: Any) -> Any:
            return jax.tree_util.tree_map(
                lambda x, axes: _pcast_to(x, axes), f(*ops), want, is_leaf=lambda x: x is None
            )

        return branch

    return lax.cond(pred, matched(true_fun), matched(false_fun), *operands)


def _pcast_to(x: Any, axes: frozenset) -> Any:
    if x is None:
        return x
    have = _varying_axes(jax.typeof(x)) or frozenset()
    missing = tuple(a for a in axes if a not in have)
    return lax.pcast(x, missing, to="varying") if missing else x


def _refuse_nested_inner(inner: Any, where: str) -> None:
    """Refuses a loss-scaling transformation as the inner one (it would unscale twice)."""
    kind = getattr(getattr(inner, "update", None), _KIND, None)
    if kind is not None:
        raise ValueError(
            f"{where}: inner is itself lossscale_jax.{kind}(...): the gradients would be "
            "unscaled twice and checked against the wrong scale. Use one loss-scaling "
            "transformation, outermost: lossscale_jax.loss_scaling(inner, policy) (or "
            "loss_scaling_multi_steps(inner, policy, every_k) to accumulate)."
        )


def _refuse_nested_state(inner_state: Any, where: str) -> None:
    """Refuses an inner state that holds a loss-scale state or an optax.MultiSteps state."""

    def marked(x: Any) -> bool:
        return isinstance(x, LossScaleState | optax.MultiStepsState)

    for path, x in jax.tree_util.tree_flatten_with_path(inner_state, is_leaf=marked)[0]:
        at = jax.tree_util.keystr(path)
        if isinstance(x, LossScaleState):
            raise ValueError(
                f"{where}: inner holds another loss scaling (a LossScaleState at inner_state"
                f"{at}): the gradients would be unscaled twice and checked against the wrong "
                "scale. Use one loss-scaling transformation, outermost, with every other "
                "transformation inside it."
            )
        if isinstance(x, optax.MultiStepsState):
            raise ValueError(
                f"{where}: inner holds optax.MultiSteps (at inner_state{at}): the scale and "
                "the skip decision would change per micro-batch, inside the window, and an "
                "overflowing micro-batch would be dropped instead of skipping its window. "
                "Accumulate with lossscale_jax.loss_scaling_multi_steps(inner, policy, "
                "every_k=k)."
            )


def loss_scaling(
    inner: optax.GradientTransformation,
    policy: LossScalePolicy,
    *,
    overflow: numerics.OverflowMode = "ieee",
    compute_dtype: Any = jnp.float16,
    axis_name: AxisName | None = None,
    on_stuck: str = "skip",
    local_axes: AxisName | None = None,
    attribution: str | None = "reduced",
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` with loss scaling: unscale, check, adjust, skip on overflow.

    Rule (one ``update``)::

      flags = overflow_flags(scaled_grads)             # one per leaf; one read of the grads
      overflow = any(flags) over axis_name              # one collective
      leaf_overflow = flags                             # (ORed over axis_name if "reduced")
      loss_scale = policy.adjust(loss_scale, overflow)
      if not loss_scale.last_skipped:                   # lax.cond, good branch first
          grads = unscale(scaled_grads, scale, params)
          updates, inner_state = inner.update(grads, inner_state, params)
      else:
          updates, inner_state = -0.0, inner_state      # e.g. Adam's count unchanged

    The gradients given to ``update`` are the gradients of
    ``scale_loss(loss, opt_state)``; ``inner`` sees the unscaled gradients,
    in the dtype of their parameters when ``params`` is passed. A skipped
    step's updates are ``-0.0``, so ``params + updates`` is bit-identical to
    ``params`` (``-0.0`` parameters included). A scale in the state that is
    not finite and > 0 (a corrupted checkpoint) counts as an overflow.

    ``loss_scaling`` must be the outermost transformation: put clipping,
    schedules, masks and weight decay inside it (they then see unscaled
    gradients and do not run on skipped steps). Wrapping it in another
    transformation (``optax.chain`` with others, ``MultiSteps``,
    ``inject_hyperparams``, ``masked``, ...) is refused when its state is
    read (``scale_loss``, ``metrics``, ``TrainState.create``); nesting it in
    another loss scaling, or ``optax.MultiSteps`` in it, is refused here or at
    ``init``. Accumulate with ``loss_scaling_multi_steps``.

    Args:
      inner: any Optax transformation (it sees unscaled gradients).
      policy: ``NoScale()``, ``StaticScale(...)`` or ``DynamicScale(...)``.
      overflow: ``"ieee"`` (inf/nan), ``"saturating"`` (``|g| >= finfo.max`` of
        ``compute_dtype``, what a saturating device writes) or ``"both"``.
      compute_dtype: the dtype of the backward pass (sets the saturating
        threshold); default float16.
      axis_name: a ``pmap``/``shard_map`` axis name, or a tuple of names, over
        which the overflow flag is reduced so every device takes the same
        decision. ``None`` for one device or sharded ``jit``.
      on_stuck: what a step does that overflows with the scale already at its
        floor (``LossScaleState.stuck``): ``"skip"`` (default) skips it like any
        overflow; ``"error"`` also fails a ``checkify`` check (wrap the step in
        ``jax.experimental.checkify.checkify`` to collect it). Either way the
        inner transformation never sees the non-finite gradients.
      local_axes: mapped axis name(s) over which the flag is deliberately not
        reduced: each device decides from its own gradients (devices training
        separate models). Under ``pmap``/``shard_map`` every bound axis must be
        in ``axis_name`` or ``local_axes`` (checked when the update is traced;
        see docs/data_parallel.md).
      attribution: the per-leaf overflow record kept in the state
        (``LossScalingState.leaf_overflow``, read by ``metrics`` and
        ``overflowed_leaves``). The flags are the check's own per-leaf results:
        no extra pass over the gradients. ``"reduced"`` (default): a leaf is
        flagged if it overflowed on any device of ``axis_name``; the flags
        travel in the flag's all-reduce (``n_leaves + 1`` int32 instead of one),
        so every device keeps the same state. ``"local"``: each device records
        its own leaves (the all-reduce stays scalar; the states then differ
        between devices in this field: under ``shard_map`` return it with a
        sharded ``out_specs``). ``None``: no record. Without ``axis_name`` the
        first two are the same.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Raises:
      TypeError, ValueError: for a bad argument, or when ``inner`` is itself a
        loss-scaling transformation (it would unscale twice).

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> params = {"w": jnp.ones(3)}
      >>> tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=2.0**10))
      >>> opt_state = tx.init(params)
      >>> loss = lambda p: jnp.sum(p["w"] ** 2)
      >>> grads = jax.grad(lambda p: lsj.scale_loss(loss(p), opt_state))(params)
      >>> updates, opt_state = tx.update(grads, opt_state, params)
      >>> updates["w"]
      Array([-0.2, -0.2, -0.2], dtype=float32)

    References:
      Micikevicius et al, `Mixed Precision Training
      <https://arxiv.org/abs/1710.03740>`_, 2018.
    """
    if not isinstance(inner, optax.GradientTransformation | optax.GradientTransformationExtraArgs):
        if not (hasattr(inner, "init") and hasattr(inner, "update")):
            raise TypeError(
                f"inner must be an optax.GradientTransformation, got {type(inner).__name__}."
            )
    if not isinstance(policy, LossScalePolicy):
        raise TypeError(
            "policy must be a lossscale_jax policy (NoScale, StaticScale, DynamicScale), "
            f"got {policy!r}."
        )
    mode = numerics.validate_overflow_mode(overflow)
    compute_dtype = numerics.validate_compute_dtype(compute_dtype)
    reduced, local = _validate_axes(axis_name, local_axes)
    on_stuck = stuck.validate_on_stuck(on_stuck)
    attribution = validate_attribution(attribution)
    _refuse_nested_inner(inner, "loss_scaling")
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> LossScalingState:
        inner_state = inner.init(params)
        _refuse_nested_state(inner_state, "loss_scaling")
        return LossScalingState(
            loss_scale=policy.init(),
            inner_state=inner_state,
            leaf_overflow=_empty_record(params, attribution),
        )

    def decide(
        updates: optax.Updates, loss_scale: LossScaleState, record: jax.Array | None
    ) -> tuple[LossScaleState, jax.Array, jax.Array | None]:
        """The adjusted loss-scale state, whether to apply the update, the new record."""
        _check_mapped_axes(updates, reduced, local, mode, "loss_scaling")
        # One read of the scaled gradients (the per-leaf flags are the check's own
        # results); the unscale happens inside the conditional, fused with the inner
        # update (no unscaled copy is written to memory). A scale that is not finite
        # and > 0 (a corrupted state) counts as overflow.
        found, record, amax = _check_and_reduce(
            updates,
            loss_scale.scale,
            record,
            mode,
            compute_dtype,
            axis_name,
            attribution,
            with_range=policy.measures_range,
        )
        loss_scale = _adjust(policy, loss_scale, found, amax)
        stuck.check_stuck(loss_scale, on_stuck)
        return loss_scale, jnp.logical_not(loss_scale.last_skipped), record

    def update_fn(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScalingState]:
        if not isinstance(state, LossScalingState):
            raise TypeError(
                "state must be the LossScalingState made by this transformation's init, got "
                f"{type(state).__name__} (an optimizer state without loss scaling?)."
            )
        loss_scale, apply, record = decide(updates, state.loss_scale, state.leaf_overflow)
        scale = state.loss_scale.scale

        def apply_inner(operands):
            g, inner_state = operands
            g = numerics.unscale(g, scale, params)
            return inner.update(g, inner_state, params, **extra_args)

        out_shapes = jax.eval_shape(apply_inner, (updates, state.inner_state))[0]

        def skip(operands):
            _, inner_state = operands
            return _skip_updates(out_shapes), inner_state

        # Good branch first: XLA:CPU inserts fewer copies for this order.
        new_updates, inner_state = _cond(apply, apply_inner, skip, (updates, state.inner_state))
        return new_updates, LossScalingState(loss_scale, inner_state, record)

    # What `lossscale_jax.apply_gradients` needs to run the same step fused.
    setattr(update_fn, _PARTS, _LossScalingParts(inner=inner, decide=decide))
    setattr(update_fn, _KIND, "loss_scaling")

    # leaf_overflow may be None (no record): a leafless pytree optax's OptState alias omits.
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def _is_loss_scale_state(x: Any) -> bool:
    return isinstance(x, LossScaleState)


# States whose ``loss_scale`` field is the LossScaleState of a loss-scaling
# transformation of this library (``accumulation`` adds its own).
_OWNER_TYPES: list[type] = [LossScalingState]

_INSIDE_CHAIN = (
    "lossscale_jax.loss_scaling is one of {n} transformations in an optax.chain (a tuple "
    "state): those before it see the scaled gradients (inf included; clipping them is wrong), "
    "those after it run on skipped steps (a schedule or Adam counts them, add_decayed_weights "
    "moves the parameters). Put them inside: lossscale_jax.loss_scaling(optax.chain(...), "
    "policy). (If this tuple is your own container, pass the loss-scaled optimizer's state "
    "itself.)"
)

# Optax wrappers around a loss scaling: why each is refused, and the fix.
_WRAPPED = {
    "MultiStepsState": (
        "lossscale_jax.loss_scaling is wrapped in optax.MultiSteps: it averages the scaled "
        "micro-gradients before the overflow check (a saturated 65504 becomes 65504/k and is "
        "missed) and resets its accumulator as (1 - emit) * acc, so one inf micro-batch leaves "
        "nan in it for good. Accumulate with lossscale_jax.loss_scaling_multi_steps(inner, "
        "policy, every_k=k)."
    ),
    "InjectHyperparamsState": (
        "lossscale_jax.loss_scaling is wrapped in optax.inject_hyperparams: its step count (and "
        "the schedules it evaluates) advances on skipped steps. Inject inside instead: "
        "lossscale_jax.loss_scaling(optax.inject_hyperparams(optax.adam)(learning_rate=...), "
        "policy)."
    ),
    "MaskedState": (
        "lossscale_jax.loss_scaling is wrapped in optax.masked: the leaves outside the mask "
        "get the raw scaled gradients (inf included). Mask inside instead: "
        "lossscale_jax.loss_scaling(optax.masked(inner, mask), policy)."
    ),
    "MultiTransformState": (
        "lossscale_jax.loss_scaling is wrapped in optax.multi_transform (or partition): the "
        "other labels' transformations get the raw scaled gradients and run on skipped steps. "
        "Partition inside instead: lossscale_jax.loss_scaling(optax.multi_transform(...), "
        "policy)."
    ),
    "ApplyIfFiniteState": (
        "lossscale_jax.loss_scaling is wrapped in optax.apply_if_finite: it sees the scaled "
        "gradients and counts its own errors on steps loss scaling already skips. Drop it "
        "(loss_scaling skips non-finite steps) or put it inside loss_scaling."
    ),
}
_WRAPPED["ConditionallyMaskState"] = _WRAPPED["ConditionallyTransformState"] = (
    "lossscale_jax.loss_scaling is wrapped in optax.conditionally_mask/conditionally_transform: "
    "its condition and step counter run on the scaled gradients and on skipped steps. Put it "
    "inside: lossscale_jax.loss_scaling(optax.conditionally_transform(...), policy)."
)
_WRAPPED["InjectStatefulHyperparamsState"] = _WRAPPED["InjectHyperparamsState"]
_WRAPPED["PartitionState"] = _WRAPPED["MultiTransformState"]


def _wrapped_message(node: Any) -> str:
    name = type(node).__name__
    if name in _WRAPPED:
        return _WRAPPED[name]
    return (
        f"lossscale_jax.loss_scaling is wrapped in an optax transformation whose state is "
        f"{name}: a wrapper outside loss scaling sees the scaled gradients and runs on skipped "
        "steps. Make loss_scaling the outermost transformation and put the wrapper inside it: "
        "lossscale_jax.loss_scaling(wrapper(...), policy)."
    )


def _children(node: Any) -> list[tuple[Any, Any]]:
    """``(key, child)`` one level down ``node`` (nothing for a leaf)."""
    flat = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
    return [(path[0], child) for path, child in flat if path]


def _check_path(root: Any, path: tuple) -> Any:
    """Walks ``path`` from ``root`` to a LossScaleState; returns the state owning it.

    Raises ``ValueError`` for every container on the way that is a refused
    nesting (see ``get_loss_scale_state``); the owner is ``None`` for a bare
    LossScaleState or one inside the user's own containers.
    """
    node, owner = root, None
    for key in path:
        if type(node) in _OWNER_TYPES:
            owner = node
        elif type(node) is tuple and len(node) > 1:
            raise ValueError(_INSIDE_CHAIN.format(n=len(node)))
        elif type(node).__module__.split(".")[0] == "optax":
            raise ValueError(_wrapped_message(node))
        node = next(child for k, child in _children(node) if k == key)
    return owner


def _locate(opt_state: Any) -> tuple[LossScaleState, Any]:
    """``(loss_scale_state, owner)``: the one LossScaleState and the state holding it.

    ``owner`` is the ``LossScalingState``/``LossScalingMultiStepsState`` whose
    ``loss_scale`` it is, or ``None`` for a bare ``LossScaleState``. Raises as
    ``get_loss_scale_state``.
    """
    if isinstance(opt_state, LossScaleState):
        return opt_state, None
    found = [
        (path, x)
        for path, x in jax.tree_util.tree_flatten_with_path(
            opt_state, is_leaf=_is_loss_scale_state
        )[0]
        if isinstance(x, LossScaleState)
    ]
    if not found:
        raise ValueError(
            "opt_state contains no LossScaleState: build the optimizer with "
            "lossscale_jax.loss_scaling(...) and pass its state (or the LossScaleState)."
        )
    if len(found) > 1:
        raise ValueError(
            f"opt_state contains {len(found)} LossScaleStates; pass the one you mean "
            "(e.g. get it from the inner state yourself)."
        )
    path, state = found[0]
    return state, _check_path(opt_state, path)


def get_loss_scale_state(opt_state: Any) -> LossScaleState:
    """Finds the one ``LossScaleState`` in an optimizer state, refusing unsafe nestings.

    Rule (the path from the root of ``opt_state`` to its ``LossScaleState``)::

      LossScalingState / LossScalingMultiStepsState  -> its loss_scale: fine
      a tuple of one element (optax.chain(loss_scaling(...)))      : fine
      your own containers (dict, list, dataclass, ...)              : fine
      a tuple of several (optax.chain with other transformations)   : ValueError
      any optax wrapper state (MultiSteps, inject_hyperparams,
        masked, multi_transform, apply_if_finite, ...)               : ValueError

    A wrapper outside loss scaling sees the scaled gradients (inf included)
    or runs on skipped steps; each error names the problem and the nesting
    that works (the wrapper inside ``loss_scaling``, or
    ``loss_scaling_multi_steps`` for accumulation). ``scale_loss``,
    ``metrics``, ``switch_policy``, ``TrainState.create`` and
    ``LossScaleOptimizer`` all read the state through it.

    Args:
      opt_state: an optimizer state, or a ``LossScaleState``.

    Returns:
      The ``LossScaleState``.

    Raises:
      ValueError: if ``opt_state`` holds no ``LossScaleState``, more than one,
        or one inside a refused nesting.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> tx = lsj.loss_scaling(optax.adam(1e-3), lsj.StaticScale(8.0))
      >>> float(lsj.get_loss_scale_state(tx.init({"w": jnp.zeros(2)})).scale)
      8.0
      >>> wrapped = optax.MultiSteps(tx, every_k_schedule=2)
      >>> try:
      ...     lsj.get_loss_scale_state(wrapped.init({"w": jnp.zeros(2)}))
      ... except ValueError as e:
      ...     print(str(e)[:60])
      lossscale_jax.loss_scaling is wrapped in optax.MultiSteps: i
    """
    return _locate(opt_state)[0]


def switch_policy(opt_state: Any, policy: LossScalePolicy) -> Any:
    """Moves the loss-scale state inside ``opt_state`` to where ``policy`` keeps it.

    For a mid-run change of policy (a lower static scale, a raised
    ``min_scale``) or a checkpoint resumed under another policy: call it on
    the state before the next ``scale_loss``, with the transformation rebuilt
    around the new policy, so the next step's gradients are already scaled by
    the new policy's scale.

    Rule::

      loss_scale = policy.conform(loss_scale)
        # StaticScale(s): scale = s; NoScale: 1;
        # DynamicScale / TolerantDynamicScale: clip(scale, min_scale, max_scale)
        # if the scale moved: growth_count = hysteresis_count = 0
        # kept: the telemetry (total_steps, overflow_steps, skipped_steps), the flags
      everything else in opt_state is returned as it is

    The growth and hysteresis counters count from the last change of the
    scale, so they restart when it moves (as after any backoff or growth) and
    are kept when it does not: a dynamic run continues where it was.

    Args:
      opt_state: an optimizer state holding one ``LossScaleState`` (as
        ``get_loss_scale_state`` reads it), or a ``LossScaleState``.
      policy: the policy to continue with.

    Returns:
      ``opt_state`` of the same structure, with the ``LossScaleState`` replaced.

    Raises:
      TypeError: if ``policy`` is not a lossscale_jax policy.
      ValueError: as ``get_loss_scale_state``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> params = {"w": jnp.zeros(2)}
      >>> opt_state = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale()).init(params)
      >>> new_policy = lsj.StaticScale(128.0)
      >>> tx = lsj.loss_scaling(optax.sgd(0.1), new_policy)
      >>> opt_state = lsj.switch_policy(opt_state, new_policy)
      >>> float(lsj.get_loss_scale_state(opt_state).scale)
      128.0
    """
    if not isinstance(policy, LossScalePolicy):
        raise TypeError(
            "policy must be a lossscale_jax policy (NoScale, StaticScale, DynamicScale), "
            f"got {policy!r}."
        )
    return set_loss_scale_state(opt_state, policy.conform(get_loss_scale_state(opt_state)))


def _avals(state: LossScaleState) -> list[tuple[str, tuple[int, ...], str]]:
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return [
        (jax.tree_util.keystr(path), tuple(jnp.shape(x)), jnp.dtype(x.dtype).name)
        for path, x in leaves
    ]


def set_loss_scale_state(opt_state: Any, loss_scale_state: LossScaleState) -> Any:
    """``opt_state`` with its one ``LossScaleState`` replaced by ``loss_scale_state``.

    The way to resume a run brought over from another framework: build the
    optimizer with the imported policy, ``init`` it, then put the imported
    state in (the inner optimizer's state is restored as usual, or starts
    fresh). ``switch_policy`` is this call with ``policy.conform`` of the
    current state.

    Rule::

      find the one LossScaleState in opt_state (as get_loss_scale_state does,
        refusing the same nestings)
      check loss_scale_state has its fields, shapes and dtypes
      return opt_state with it replaced (the rest unchanged)

    Args:
      opt_state: an optimizer state holding exactly one ``LossScaleState``
        (as ``get_loss_scale_state`` reads it), or a ``LossScaleState`` itself.
      loss_scale_state: the state to put in, e.g. from
        ``compat.torch.import_state(...)``.

    Returns:
      The optimizer state, same structure, with the new loss-scale state.

    Raises:
      ValueError: as ``get_loss_scale_state``, or if ``loss_scale_state`` does
        not have the same fields, shapes and dtypes.
      TypeError: if ``loss_scale_state`` is not a ``LossScaleState``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> from lossscale_jax import compat
      >>> policy, state = compat.torch.import_state({
      ...     "scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
      ...     "growth_interval": 2000, "_growth_tracker": 7})
      >>> tx = lsj.loss_scaling(optax.sgd(0.1), policy)
      >>> opt_state = lsj.set_loss_scale_state(tx.init({"w": jnp.zeros(2)}), state)
      >>> float(lsj.metrics(opt_state)["loss_scale"]), int(opt_state.loss_scale.growth_count)
      (1024.0, 7)
    """
    if not isinstance(loss_scale_state, LossScaleState):
        raise TypeError(
            f"loss_scale_state must be a LossScaleState, got {type(loss_scale_state).__name__}."
        )
    current = get_loss_scale_state(opt_state)
    if _avals(current) != _avals(loss_scale_state):
        raise ValueError(
            "loss_scale_state does not match the optimizer state's LossScaleState (fields, "
            f"shapes, dtypes): {_avals(loss_scale_state)} vs {_avals(current)}. Build it with "
            "the policy's init() (the compat import functions do)."
        )
    if isinstance(opt_state, LossScaleState):
        return loss_scale_state
    return jax.tree_util.tree_map(
        lambda x: loss_scale_state if _is_loss_scale_state(x) else x,
        opt_state,
        is_leaf=_is_loss_scale_state,
    )


def scale_loss(loss: ArrayLike, state: Any) -> jax.Array:
    """Multiplies ``loss`` by the current loss scale.

    Rule::

      scaled = loss * scale          # in float32 at least

    Args:
      loss: a floating scalar (the loss to differentiate).
      state: an optimizer state holding a ``LossScaleState`` (see
        ``get_loss_scale_state``) or the ``LossScaleState`` itself.

    Returns:
      The scaled loss, in the dtype of ``loss`` promoted to at least float32.

    Raises:
      TypeError: if ``loss`` is not floating; ValueError if it is not a scalar.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> params = {"w": jnp.ones(3)}
      >>> tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=2.0**10))
      >>> state = tx.init(params)
      >>> loss16 = jnp.asarray(0.5, jnp.float16)
      >>> scaled = lsj.scale_loss(loss16, state)
      >>> float(scaled), scaled.dtype                   # promoted to float32
      (512.0, dtype('float32'))
      >>> grads = jax.grad(lambda p: lsj.scale_loss(jnp.sum(p["w"]) / 4, state))(params)
      >>> grads["w"].tolist()                           # scaled: tx.update divides them back
      [256.0, 256.0, 256.0]
    """
    scale = get_loss_scale_state(state).scale
    loss = jnp.asarray(loss)
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(f"loss must be a floating scalar, got dtype {loss.dtype}.")
    if loss.shape != ():
        raise ValueError(
            f"loss must be a scalar, got shape {loss.shape}; reduce it (e.g. mean) first."
        )
    dtype = numerics.at_least_float32(loss.dtype)
    return loss.astype(dtype) * scale.astype(dtype)


def metrics(opt_state: Any) -> dict[str, jax.Array]:
    """A flat dict of scalars for logging, computed without leaving the device.

    Keys:

    - ``loss_scale`` (float32);
    - ``overflow``, ``skipped``, ``stuck`` (bool, the last step; ``stuck``: it
      overflowed with the scale already at its floor);
    - ``total_steps``, ``overflow_steps``, ``skipped_steps`` (int32);
    - ``overflow_rate`` (float32): ``overflow_steps / total_steps``, 0 before
      the first step;
    - ``recent_overflow_rate`` (float32): the fraction of recent steps that
      overflowed (``LossScaleState.recent_overflow_rate``). For the first 2000
      steps it is ``overflow_rate`` (the mean so far); after that an
      exponential moving average of the overflow flag with weight 1/2000
      (a step's weight halves in about 1400 steps), started from that mean.
      Alert on it mid-run: keep it under 0.5% (0.1% for a large global batch);
    - when the state keeps a per-leaf overflow record (``loss_scaling``'s
      ``attribution``, on by default): ``overflow_leaves`` (int32, how many
      gradient leaves overflowed at the last step) and ``first_overflow_leaf``
      (int32, the index in ``jax.tree_util.tree_leaves(params)`` of the first
      one, -1 if none). ``overflowed_leaves(opt_state, params)`` names them.

    Under accumulation (``loss_scaling_multi_steps``) a step is a window. An
    overflow caused by a bad scale in the state (not finite, or <= 0) flags no
    leaf.

    Rule::

      rate = overflow_steps / total_steps                       # 0 before the first step
      recent = rate if total_steps <= 2000                      # updated at each step
               else recent + (overflow - recent) / 2000
      overflow_leaves = sum(leaf_overflow)
      first_overflow_leaf = argmax(leaf_overflow) if any(leaf_overflow) else -1

    Args:
      opt_state: an optimizer state holding a ``LossScaleState`` (as
        ``get_loss_scale_state`` finds it), or a ``LossScaleState``.

    Returns:
      A dict of scalar arrays (keys above).

    Raises:
      ValueError: as ``get_loss_scale_state``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> params = {"a": jnp.ones(2), "b": jnp.ones(3)}
      >>> tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=8.0))
      >>> state = tx.init(params)
      >>> _, state = tx.update({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf, 1.0])},
      ...                      state, params)
      >>> m = lsj.metrics(state)
      >>> float(m["loss_scale"]), float(m["recent_overflow_rate"])
      (4.0, 1.0)
      >>> int(m["overflow_leaves"]), int(m["first_overflow_leaf"])   # leaf 1: "b"
      (1, 1)
    """
    s, owner = _locate(opt_state)
    total = s.total_steps.astype(jnp.float32)
    rate = jnp.where(total > 0, s.overflow_steps.astype(jnp.float32) / jnp.maximum(total, 1.0), 0.0)
    out = {
        "loss_scale": s.scale,
        "overflow": s.last_overflow,
        "skipped": s.last_skipped,
        "stuck": s.stuck,
        "total_steps": s.total_steps,
        "overflow_steps": s.overflow_steps,
        "skipped_steps": s.skipped_steps,
        "overflow_rate": rate.astype(jnp.float32),
        "recent_overflow_rate": s.recent_overflow_rate,
    }
    record = getattr(owner, "leaf_overflow", None)
    if record is not None:
        record = jnp.asarray(record, jnp.bool_)
        count = jnp.sum(record, axis=-1, dtype=jnp.int32)
        if record.shape[-1] == 0:
            first = jnp.full(count.shape, -1, jnp.int32)
        else:
            first = jnp.where(count > 0, jnp.argmax(record, axis=-1), -1).astype(jnp.int32)
        out["overflow_leaves"] = count
        out["first_overflow_leaf"] = first
    return out


def overflowed_leaves(opt_state: Any, params: Any) -> list[str]:
    """The key paths of the gradient leaves that overflowed at the last step (host side).

    Reads the per-leaf overflow record of the state (``leaf_overflow`` of
    ``LossScalingState`` / ``LossScalingMultiStepsState``) back to the host:
    this synchronises with the device (it waits for the step that produced
    the state), so call it outside ``jax.jit``, when logging, e.g. when
    ``metrics(opt_state)["overflow"]`` is set. Inside ``jit`` use
    ``metrics(...)["overflow_leaves"]`` and ``["first_overflow_leaf"]``.

    Rule::

      flags = device_get(leaf_overflow)                # one flag per leaf of params
      return [keystr(path) for (path, _), flag in zip(leaves_with_path(params), flags)
              if flag]

    What the record holds: with ``attribution="reduced"`` (the default) the
    leaves that overflowed on any device of ``axis_name``; with ``"local"``
    this device's own; under ``loss_scaling_multi_steps``, those that
    overflowed in any micro-batch of the window (of the last completed
    window, after its last micro-batch). An overflow that comes from a bad
    scale in the state, not from a gradient, names no leaf.

    Args:
      opt_state: an optimizer state made by ``loss_scaling`` or
        ``loss_scaling_multi_steps`` (as ``get_loss_scale_state`` finds it).
        Under ``jax.pmap`` pass one device's state (``tree_map(lambda x: x[i],
        state)``).
      params: the parameters given to ``tx.init``, or any pytree of the same
        structure (only its key paths are read).

    Returns:
      Key paths as ``jax.tree_util.keystr`` writes them (e.g.
      ``"['params']['Dense_0']['kernel']"``), in leaf order; empty when no leaf
      overflowed.

    Raises:
      ValueError: as ``get_loss_scale_state``; if the state keeps no record
        (``attribution=None``, a bare ``LossScaleState``); if ``params`` has
        another number of leaves than the record; if the state holds one record
        per device.
      TypeError: when called on traced values (inside ``jit``).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}}
      >>> tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale())
      >>> grads = {"dense": {"kernel": jnp.full((2, 2), jnp.nan), "bias": jnp.ones(2)}}
      >>> _, state = tx.update(grads, tx.init(params), params)
      >>> lsj.overflowed_leaves(state, params)
      ["['dense']['kernel']"]
    """
    _, owner = _locate(opt_state)
    record = getattr(owner, "leaf_overflow", None)
    if record is None:
        raise ValueError(
            "opt_state keeps no per-leaf overflow record: build the optimizer with "
            "lossscale_jax.loss_scaling(...) or loss_scaling_multi_steps(...) with "
            "attribution='reduced' (the default) or 'local', and its state with tx.init(params)."
        )
    if isinstance(record, jax.core.Tracer):
        raise TypeError(
            "overflowed_leaves reads the per-leaf overflow record back to the host and cannot "
            "run inside jax.jit (or another transformation): call it on the state the step "
            "returned, or use metrics(opt_state)['overflow_leaves'] inside the step."
        )
    flags = np.asarray(jax.device_get(record))
    if flags.ndim != 1:
        raise ValueError(
            f"opt_state holds per-leaf overflow records of shape {flags.shape}, one per device "
            "(a state from jax.pmap): pass one device's state, e.g. "
            "jax.tree_util.tree_map(lambda x: x[0], opt_state)."
        )
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    if len(paths) != flags.shape[0]:
        raise ValueError(
            f"params has {len(paths)} leaves but the optimizer state's per-leaf overflow "
            f"record has {flags.shape[0]}: pass the parameters given to tx.init (or a pytree "
            "of the same structure)."
        )
    return [path for path, flag in zip(paths, flags, strict=True) if flag]
