"""``loss_scaling_multi_steps``: loss scaling over windows of micro-batches (accumulation).

One skip decision per window: every micro-batch's scaled gradient is checked as it
arrives and the window's check is the fold of theirs (the engine's ``fold``); the scale
is adjusted once, at the window's end.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from lossscale_jax import numerics
from lossscale_jax.engine._devices import AxisName
from lossscale_jax.engine._engine import (
    Check,
    Engine,
    EngineUpdate,
    check_state,
)
from lossscale_jax.engine._hyper import check_int
from lossscale_jax.engine._inner_skip import inner_or_skip, skip_updates
from lossscale_jax.engine._landing import land_first, unscale_targets, warn_float16_inner
from lossscale_jax.engine._nesting import prepare_inner, refuse_nested_state
from lossscale_jax.engine._opt_states import LossScalingMultiStepsState
from lossscale_jax.engine._window import acc_zeros, add_good, cleared
from lossscale_jax.engine._window import mean_of as window_mean
from lossscale_jax.policies import LossScalePolicy

__all__ = ["LossScalingMultiStepsState", "loss_scaling_multi_steps"]


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
    check_wiring: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Loss scaling over windows of ``every_k`` micro-batches (gradient accumulation).

    What ``optax.MultiSteps(loss_scaling(inner, policy), k)`` cannot do (that
    nesting is refused, see ``get_loss_scale_state``).
    Every micro-batch's *scaled* gradient is checked as it arrives, so an
    overflow in any micro-batch skips the whole window in every mode -- also a
    saturated 65504 that the window's mean (65504 / k) would hide. The scale
    is adjusted once per window, so it is constant within a window.

    Rule (one ``update``, one micro-batch)::

      found, flags, amax = check(scaled_grads) over axis_name   # this micro-batch
      window_overflow |= found                  # the window so far (the same on every device)
      window_leaf_overflow |= flags; window_range = max(window_range, amax)  # if kept
      if not found:
          acc_grads += unscale(scaled_grads)     # float32 at least; stays finite
      if mini_step < every_k - 1:
          mini_step += 1; return -0.0            # scale and inner state unchanged
      loss_scale = policy.adjust(loss_scale, window_overflow, window_range)
      if not loss_scale.last_skipped:
          mean = acc_grads * float32(1 / every_k)  # the reciprocal rounded to float32
          updates, inner_state = inner.update(mean, inner_state, params)
      else:
          updates = -0.0                         # the whole window is skipped
      leaf_overflow = window_leaf_overflow       # the completed window's record
      mini_step, window_overflow, window_leaf_overflow, window_range, acc_grads = 0, ...

    The loss-scale counters (``total_steps``, ``skipped_steps``, ...) count
    windows, i.e. optimizer updates. ``scale_loss`` and ``metrics`` find the
    state as usual; ``metrics`` reports the last completed window. With a
    policy that does not skip (``NoScale()``, ``StaticScale(s,
    skip_on_overflow=False)``), an overflowing micro-batch is left out of the
    sum and the window applies the others' sum divided by ``every_k``. Every call that
    applies nothing returns ``-0.0`` updates (``params + updates`` is
    bit-identical to ``params``). ``lsj.TrainState`` and
    ``lsj.LossScaleOptimizer`` count windows in ``step`` and discard model
    collections from the first overflowing micro-batch to the window's end.

    Args:
      inner: any Optax transformation (it sees the window's mean unscaled gradient).
      policy: a policy instance (see ``loss_scaling``).
      every_k: micro-batches per update (int >= 1; 1 behaves like ``loss_scaling``).
      overflow: ``"ieee"``, ``"saturating"`` or ``"both"`` (see ``loss_scaling``).
      compute_dtype: the dtype of the backward pass (sets the saturating threshold).
      axis_name: ``pmap``/``shard_map`` axis name(s) over which the flag is reduced.
      on_stuck: ``"skip"`` or ``"error"`` (see ``loss_scaling``).
      local_axes: mapped axes over which the flag is not reduced (see ``loss_scaling``).
      attribution: the per-leaf overflow record, ``"reduced"`` (default),
        ``"local"`` or ``None`` (see ``loss_scaling``); here the OR over the
        last completed window's micro-batches
        (``LossScalingMultiStepsState.leaf_overflow``).

      check_wiring: ``False`` turns the wiring check off for this transformation (the
        check that refuses, while the step is traced, gradients ``update`` must not divide
        by the scale; docs/errors.md). ``lsj.no_wiring_check()`` turns it off for a block.
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
    every_k = check_int("every_k", every_k, 1)
    engine = Engine.build(
        "loss_scaling_multi_steps",
        policy,
        overflow=overflow,
        compute_dtype=compute_dtype,
        axis_name=axis_name,
        local_axes=local_axes,
        on_stuck=on_stuck,
        attribution=attribution,
        check_wiring=check_wiring,
    )
    inner = prepare_inner(inner, "loss_scaling_multi_steps")
    measures = engine.policy.measures_range

    def init_fn(params: optax.Params) -> LossScalingMultiStepsState:
        inner_state = inner.init(params)
        refuse_nested_state(inner_state, "loss_scaling_multi_steps")
        warn_float16_inner(params, inner_state, "loss_scaling_multi_steps")
        return LossScalingMultiStepsState(
            loss_scale=engine.policy.init(),
            mini_step=jnp.zeros([], jnp.int32),
            window_overflow=jnp.zeros([], jnp.bool_),
            acc_grads=jax.tree_util.tree_map(acc_zeros, params),
            inner_state=inner_state,
            leaf_overflow=engine.empty_record(params),
            window_range=jnp.zeros([], jnp.float32),
            window_leaf_overflow=engine.empty_record(params),
        )

    def update_fn(
        updates: optax.Updates,
        state: Any,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScalingMultiStepsState]:
        state = check_state(state, LossScalingMultiStepsState, "loss_scaling_multi_steps")
        scale = state.loss_scale.scale
        # This micro-batch's check, reduced over axis_name (one collective), then folded
        # into the window's: both are the same on every device.
        taps = extra_args.pop("taps", None)  # this micro-batch's; folded like its flags
        this = engine.check(updates, scale, state.window_leaf_overflow, taps=taps)
        so_far = Check(
            state.window_overflow,
            state.window_leaf_overflow,
            state.window_range if measures else None,
        )
        window = engine.fold(so_far, this)
        grads = engine.unscale(updates, scale, unscale_targets(params, state.inner_state))

        # A micro-batch that overflowed (on any device) is left out of the sum.
        acc = add_good(state.acc_grads, grads, this.overflow)

        def mean_of(acc_tree: Any) -> Any:
            return window_mean(acc_tree, grads, every_k)

        def inner_update(g: Any, inner_state: Any) -> Any:
            return inner.update(g, inner_state, params, **extra_args)

        shapes = jax.eval_shape(inner_update, mean_of(acc), state.inner_state)
        window_range = window.amax if window.amax is not None else state.window_range
        # The window's decision, taken on every call and kept at the window's end only: outside
        # the branches, so that its stuck check fires at the end alone under either formulation.
        at_end = state.mini_step >= every_k - 1
        # float16 parameters: the window's update computed first, its landing checked.
        decided, inner_update = land_first(
            engine, window, params, inner_update, mean_of(acc), state.inner_state, scale, at_end
        )
        loss_scale, apply = engine.decide(state.loss_scale, decided, when=at_end)

        def finish(acc_tree: Any) -> Any:
            new_updates, inner_state = inner_or_skip(
                engine, apply, inner_update, mean_of(acc_tree), state.inner_state, shapes
            )
            return new_updates, LossScalingMultiStepsState(
                loss_scale=loss_scale,
                mini_step=jnp.zeros([], jnp.int32),
                window_overflow=jnp.zeros([], jnp.bool_),
                acc_grads=jax.tree_util.tree_map(jnp.zeros_like, acc_tree),
                inner_state=inner_state,
                leaf_overflow=decided.flags,
                window_range=jnp.zeros([], jnp.float32),
                window_leaf_overflow=cleared(window.flags),
            )

        def accumulate(acc_tree: Any) -> Any:
            return skip_updates(shapes[0]), LossScalingMultiStepsState(
                loss_scale=state.loss_scale,
                mini_step=(state.mini_step + 1).astype(jnp.int32),
                window_overflow=window.overflow,
                acc_grads=acc_tree,
                inner_state=state.inner_state,
                leaf_overflow=state.leaf_overflow,
                window_range=window_range,
                window_leaf_overflow=window.flags,
            )

        return engine.select(at_end, finish, accumulate, acc)

    # leaf_overflow may be None (no record): a leafless pytree optax's OptState alias omits.
    return optax.GradientTransformationExtraArgs(
        init_fn,  # pyright: ignore[reportArgumentType]
        EngineUpdate(update_fn, engine, inner),
    )
