"""Loss scaling with gradient accumulation: one skip decision per window of micro-batches."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lossscale_jax import numerics, stuck, transform
from lossscale_jax.policies import LossScalePolicy, LossScaleState, _check_int
from lossscale_jax.transform import (
    AxisName,
    LossScalingState,
    _check_mapped_axes,
    _refuse_nested_inner,
    _refuse_nested_state,
    _skip_updates,
    _validate_axes,
)


class LossScalingMultiStepsState(NamedTuple):
    """State of :func:`loss_scaling_multi_steps`.

    Attributes:
      loss_scale: the ``LossScaleState`` (constant within a window).
      mini_step: int32, micro-batches seen in the current window, in ``[0, every_k)``.
      window_overflow: bool, whether a micro-batch of the current window overflowed.
      acc_grads: the sum of the window's unscaled micro-gradients, float32 at least
        (finite always: an overflowing micro-batch is never added).
      inner_state: the state of the inner transformation.
      leaf_overflow: ``bool[n]``, one flag per leaf of the parameters given to
        ``init``: whether that leaf's gradient overflowed in a micro-batch of
        the current window so far; after a window's last micro-batch, in any
        micro-batch of that window (the window ``metrics`` reports). The first
        micro-batch of the next window starts it afresh. ``None`` when the
        transformation keeps no record (``attribution=None``).
      window_range: float32, the largest gradient range (``amax``, see
        ``HeadroomScale``) of the current window's micro-batches so far.
        ``None`` unless the policy measures it (``policy.measures_range``).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> params = {"w": jnp.ones(2)}
      >>> tx = lsj.loss_scaling_multi_steps(
      ...     optax.sgd(0.1), lsj.DynamicScale(init_scale=8.0), every_k=2)
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.full(2, 8.0)}, state, params)  # scaled by 8
      >>> int(state.mini_step), state.acc_grads["w"].tolist(), updates["w"].tolist()
      (1, [1.0, 1.0], [-0.0, -0.0])
      >>> updates, state = tx.update({"w": jnp.full(2, 24.0)}, state, params)
      >>> int(state.mini_step), updates["w"].tolist()   # -0.1 * mean(1, 3)
      (0, [-0.20000000298023224, -0.20000000298023224])
    """

    loss_scale: LossScaleState
    mini_step: jax.Array
    window_overflow: jax.Array
    acc_grads: optax.Updates
    inner_state: optax.OptState
    leaf_overflow: jax.Array | None = None
    window_range: jax.Array | None = None


transform._OWNER_TYPES.append(LossScalingMultiStepsState)


class _StepOutcome(NamedTuple):
    """What one update did, read from the new optimizer state (scalar bools).

    Attributes:
      completed: an optimizer step ended with this call (every call of
        ``loss_scaling``; the last micro-batch of a window of
        ``loss_scaling_multi_steps``), applied or skipped.
      applied: the update of that step was applied to the parameters.
      discard: what this call's forward pass wrote into model collections
        (e.g. ``batch_stats``) must not persist.
    """

    completed: jax.Array
    applied: jax.Array
    discard: jax.Array


def _step_outcome(opt_state: Any) -> _StepOutcome:
    """Reads from a new optimizer state what the update that produced it did.

    Rule::

      loss_scaling:              completed = True
                                 applied   = not last_skipped
                                 discard   = last_skipped
      loss_scaling_multi_steps:  completed = mini_step == 0         # a window just ended
                                 applied   = completed and not last_skipped
                                 discard   = window_overflow        # sticky: from the first
                                             or (completed and last_skipped)  # bad micro-batch
                                                                    # to the window's end

    In a skipped window, the collections written by the micro-batches before
    the first overflowing one persist (their forward passes were good; only
    the optimizer step is skipped); from that micro-batch to the window's end
    nothing persists.

    Raises:
      ValueError: as ``get_loss_scale_state``, or if the state holds a bare
        ``LossScaleState`` (no loss-scaling transformation made it).
    """
    loss_scale, owner = transform._locate(opt_state)
    skipped = loss_scale.last_skipped
    if isinstance(owner, LossScalingState):
        true = jnp.ones([], jnp.bool_)
        return _StepOutcome(true, jnp.logical_not(skipped), skipped)
    if isinstance(owner, LossScalingMultiStepsState):
        ended = owner.mini_step == 0
        return _StepOutcome(
            completed=ended,
            applied=jnp.logical_and(ended, jnp.logical_not(skipped)),
            discard=jnp.logical_or(owner.window_overflow, jnp.logical_and(ended, skipped)),
        )
    raise ValueError(
        "the optimizer state holds a bare LossScaleState, not the state of "
        "lossscale_jax.loss_scaling or loss_scaling_multi_steps: build tx with one of them."
    )


def _acc_zeros(p: Any) -> jax.Array:
    if numerics._is_float(p):
        return jnp.zeros(jnp.shape(p), numerics.at_least_float32(p.dtype))
    # Non-floating parameters have no gradient to accumulate; keep a placeholder.
    return jnp.zeros([], jnp.int32)


def loss_scaling_multi_steps(
    inner: optax.GradientTransformation,
    policy: LossScalePolicy,
    every_k: int,
    *,
    overflow: numerics.OverflowMode = "ieee",
    compute_dtype: Any = jnp.float16,
    axis_name: AxisName | None = None,
    on_stuck: str = "skip",
    local_axes: AxisName | None = None,
    attribution: str | None = "reduced",
) -> optax.GradientTransformationExtraArgs:
    """Loss scaling over windows of ``every_k`` micro-batches (gradient accumulation).

    What ``optax.MultiSteps(loss_scaling(inner, policy), k)`` cannot do (that
    nesting is refused, see ``get_loss_scale_state``).
    Every micro-batch's *scaled* gradient is checked as it arrives, so an
    overflow in any micro-batch skips the whole window in every mode -- also a
    saturated 65504 that the window's mean (65504 / k) would hide. The scale
    is adjusted once per window, so it is constant within a window.

    Rule (one ``update``, one micro-batch)::

      grads, found = unscale_and_check(scaled_grads, scale, params)
      window_overflow = any(window_overflow or found over axis_name)
      leaf_overflow = flags if mini_step == 0 else leaf_overflow | flags  # per leaf
      window_range = amax if mini_step == 0 else max(window_range, amax)  # if measured
      if not window_overflow:
          acc_grads += grads                     # float32 at least; stays finite
      if mini_step < every_k - 1:
          mini_step += 1; return -0.0            # scale and inner state unchanged
      loss_scale = policy.adjust(loss_scale, window_overflow)   # amax=window_range if measured
      if not loss_scale.last_skipped:
          updates, inner_state = inner.update(acc_grads / every_k, inner_state, params)
      else:
          updates = -0.0                         # the whole window is skipped
      mini_step, window_overflow, acc_grads = 0, False, zeros

    The loss-scale counters (``total_steps``, ``skipped_steps``, ...) count
    windows, i.e. optimizer updates. ``scale_loss`` and ``metrics`` find the
    state as usual. With a policy that does not skip (``NoScale()``), an
    overflowing micro-batch is still left out of the sum. Every call that
    applies nothing returns ``-0.0`` updates (``params + updates`` is
    bit-identical to ``params``). ``lsj.TrainState`` and
    ``lsj.LossScaleOptimizer`` count windows in ``step`` and discard model
    collections from the first overflowing micro-batch to the window's end.

    Args:
      inner: any Optax transformation (it sees the window's mean unscaled gradient).
      policy: ``NoScale()``, ``StaticScale(...)`` or ``DynamicScale(...)``.
      every_k: micro-batches per update (int >= 1; 1 behaves like ``loss_scaling``).
      overflow: ``"ieee"``, ``"saturating"`` or ``"both"`` (see ``loss_scaling``).
      compute_dtype: the dtype of the backward pass (sets the saturating threshold).
      axis_name: ``pmap``/``shard_map`` axis name(s) over which the flag is reduced.
      on_stuck: ``"skip"`` or ``"error"`` (see ``loss_scaling``).
      local_axes: mapped axes over which the flag is not reduced (see ``loss_scaling``).
      attribution: the per-leaf overflow record, ``"reduced"`` (default),
        ``"local"`` or ``None`` (see ``loss_scaling``); here the OR over the
        window's micro-batches (``LossScalingMultiStepsState.leaf_overflow``).

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its state is a
      ``LossScalingMultiStepsState``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> params = {"w": jnp.zeros(2)}
      >>> tx = lsj.loss_scaling_multi_steps(optax.sgd(1.0), lsj.StaticScale(4.0), every_k=2,
      ...                                   overflow="saturating")
      >>> s = tx.init(params)
      >>> u, s = tx.update({"w": jnp.array([65504.0, 4.0], jnp.float16)}, s, params)
      >>> u, s = tx.update({"w": jnp.array([4.0, 4.0], jnp.float16)}, s, params)
      >>> u["w"], bool(s.loss_scale.last_skipped)
      (Array([-0., -0.], dtype=float32), True)

    Raises:
      TypeError, ValueError: for a bad argument, or when ``inner`` is itself a
        loss-scaling transformation.
    """
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(
            f"inner must be an optax.GradientTransformation, got {type(inner).__name__}."
        )
    if not isinstance(policy, LossScalePolicy):
        raise TypeError(
            "policy must be a lossscale_jax policy (NoScale, StaticScale, DynamicScale), "
            f"got {policy!r}."
        )
    every_k = _check_int("every_k", every_k, 1)
    mode = numerics.validate_overflow_mode(overflow)
    compute_dtype = numerics.validate_compute_dtype(compute_dtype)
    reduced, local = _validate_axes(axis_name, local_axes)
    on_stuck = stuck.validate_on_stuck(on_stuck)
    attribution = transform.validate_attribution(attribution)
    _refuse_nested_inner(inner, "loss_scaling_multi_steps")
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> LossScalingMultiStepsState:
        inner_state = inner.init(params)
        _refuse_nested_state(inner_state, "loss_scaling_multi_steps")
        return LossScalingMultiStepsState(
            loss_scale=policy.init(),
            mini_step=jnp.zeros([], jnp.int32),
            window_overflow=jnp.zeros([], jnp.bool_),
            acc_grads=jax.tree_util.tree_map(_acc_zeros, params),
            inner_state=inner_state,
            leaf_overflow=transform._empty_record(params, attribution),
            window_range=jnp.zeros([], jnp.float32) if policy.measures_range else None,
        )

    def update_fn(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScalingMultiStepsState]:
        if not isinstance(state, LossScalingMultiStepsState):
            raise TypeError(
                "state must be the LossScalingMultiStepsState made by this transformation's "
                f"init, got {type(state).__name__}."
            )
        _check_mapped_axes(updates, reduced, local, mode, "loss_scaling_multi_steps")
        scale = numerics._valid_scale(state.loss_scale.scale)
        grads = numerics.unscale(updates, scale, params)
        # The check of unscale_and_check, keeping its per-leaf flags; the flag and the
        # record are ORed over the window and reduced over axis_name (one collective).
        # With a policy that measures the range, the window's largest range rides along.
        window_overflow, record, window_range = transform._check_and_reduce(
            updates,
            scale,
            state.leaf_overflow,
            mode,
            compute_dtype,
            axis_name,
            attribution,
            window=(state.window_overflow, state.mini_step == 0),
            with_range=policy.measures_range,
            window_range=state.window_range,
        )

        def add(acc, g):
            if not numerics._is_float(g):
                return acc
            return acc + g.astype(acc.dtype)

        acc = transform._cond(
            window_overflow,
            lambda a, g: a,
            lambda a, g: jax.tree_util.tree_map(add, a, g),
            state.acc_grads,  # under shard_map: each device's own sum (transform.cond)
            grads,
        )

        def mean_of(acc_tree):
            def leaf(a, g):
                if not numerics._is_float(g):
                    return g
                return (a / jnp.asarray(every_k, a.dtype)).astype(g.dtype)

            return jax.tree_util.tree_map(leaf, acc_tree, grads)

        def apply_inner(operands):
            g, inner_state = operands
            return inner.update(g, inner_state, params, **extra_args)

        out_shapes = jax.eval_shape(apply_inner, (mean_of(acc), state.inner_state))[0]

        def zeros():
            return _skip_updates(out_shapes)

        def finish(acc_tree):
            loss_scale = transform._adjust(policy, state.loss_scale, window_overflow, window_range)
            stuck.check_stuck(loss_scale, on_stuck)
            new_updates, inner_state = transform._cond(
                jnp.logical_not(loss_scale.last_skipped),
                apply_inner,
                lambda operands: (zeros(), operands[1]),
                (mean_of(acc_tree), state.inner_state),
            )
            return new_updates, LossScalingMultiStepsState(
                loss_scale=loss_scale,
                mini_step=jnp.zeros([], jnp.int32),
                window_overflow=jnp.zeros([], jnp.bool_),
                acc_grads=jax.tree_util.tree_map(jnp.zeros_like, acc_tree),
                inner_state=inner_state,
                leaf_overflow=record,
                window_range=None if window_range is None else jnp.zeros([], jnp.float32),
            )

        def accumulate(acc_tree):
            return zeros(), LossScalingMultiStepsState(
                loss_scale=state.loss_scale,
                mini_step=(state.mini_step + 1).astype(jnp.int32),
                window_overflow=window_overflow,
                acc_grads=acc_tree,
                inner_state=state.inner_state,
                leaf_overflow=record,
                window_range=window_range,
            )

        return transform._cond(state.mini_step >= every_k - 1, finish, accumulate, acc)

    setattr(update_fn, transform._KIND, "loss_scaling_multi_steps")
    # leaf_overflow may be None (no record): a leafless pytree optax's OptState alias omits.
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
