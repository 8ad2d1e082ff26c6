"""The optimizer states of the loss-scaling transformations, and what an update did.

``LossScalingState`` (``loss_scaling``, ``compat.torch.multi_optimizer``) and
``LossScalingMultiStepsState`` (``loss_scaling_multi_steps``) hold the ``LossScaleState``
beside the inner optimizer's state. ``step_outcome`` reads from a new state whether the
update that made it completed an optimizer step, applied it, and whether the model
collections written by that call must be discarded (the Flax train states use it).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lossscale_jax.engine._state import LossScaleState


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


class LossScalingMultiStepsState(NamedTuple):
    """State of :func:`loss_scaling_multi_steps`.

    Every field that describes a step describes the last *completed* window
    (optimizer update): ``loss_scale`` and ``leaf_overflow``, and so every key
    of ``metrics``. The window in progress has fields of its own.

    Attributes:
      loss_scale: the ``LossScaleState`` (constant within a window).
      mini_step: int32, micro-batches seen in the current window, in ``[0, every_k)``.
      window_overflow: bool, whether a micro-batch of the current window overflowed.
      acc_grads: the sum of the window's unscaled micro-gradients, float32 at least
        (finite always: an overflowing micro-batch is never added).
      inner_state: the state of the inner transformation.
      leaf_overflow: ``bool[n]``, one flag per leaf of the parameters given to
        ``init``: whether that leaf's gradient overflowed in a micro-batch of
        the last completed window (what ``metrics`` and ``overflowed_leaves``
        report). ``None`` when the transformation keeps no record
        (``attribution=None``).
      window_range: float32, the largest gradient range (``amax``, see
        ``HeadroomScale``) of the current window's micro-batches so far; kept
        (0) for every policy, so a checkpoint moves between policies.
      window_leaf_overflow: ``bool[n]``, the per-leaf record of the current
        window so far (``None`` without a record).

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
    window_leaf_overflow: jax.Array | None = None


class LayerScales(NamedTuple):
    """Per-layer scaling: one entry per segment (the layers in forward order, then the loss).

    Each segment runs ``HeadroomScale``'s rule on its own range (see ``layerwise_scaling``).

    Attributes:
      scale: float32[n + 1], each segment's cumulative scale (a power of two); the last
        is the loss scale (``loss_scale.scale``).
      range_peak: float32[n + 1], each segment's held peak of its range at scale 1.
      margin: int32[n + 1], each segment's margin in octaves.
      growth_count: int32[n + 1], good steps since the segment's margin last changed.
      overflow_steps: int32[n + 1], overflows attributed to the segment (the one closest to
        the loss among those that overflowed).
    """

    scale: jax.Array
    range_peak: jax.Array
    margin: jax.Array
    growth_count: jax.Array
    overflow_steps: jax.Array


class LayerWindow(NamedTuple):
    """Per-layer scaling with accumulation: the window of micro-batches in progress.

    Attributes:
      mini_step: int32, micro-batches seen in the window, in ``[0, every_k)``.
      overflow: bool, whether a micro-batch of the window overflowed.
      segments: bool[n + 1], which segments overflowed in the window.
      amax: float32[n + 1], each segment's largest range in the window.
      acc_grads: the sum of the window's unscaled good micro-gradients (float32 at least).
      leaf_overflow: the window's per-leaf record so far (``None`` without a record).
    """

    mini_step: jax.Array
    overflow: jax.Array
    segments: jax.Array
    amax: jax.Array
    acc_grads: optax.Updates
    leaf_overflow: jax.Array | None = None


class LayerwiseScalingState(NamedTuple):
    """State of :func:`lossscale_jax.layerwise.layerwise_scaling`.

    Attributes:
      loss_scale: the ``LossScaleState`` of the whole model: the loss scale (the loss
        segment's), the skip decision and its telemetry, as ``loss_scaling`` keeps it.
      layers: the per-segment scales (``LayerScales``).
      inner_state: the state of the inner transformation.
      leaf_overflow: ``bool[n_leaves]``, which leaves overflowed at the last step (of the
        last completed window, with accumulation) (``None`` without a record).
      window: with accumulation (``every_k > 1``) the window in progress, else ``None``.
    """

    loss_scale: LossScaleState
    layers: LayerScales
    inner_state: optax.OptState
    leaf_overflow: jax.Array | None = None
    window: LayerWindow | None = None


class MasterWeightsState(NamedTuple):
    """State of :func:`master_weights`: float32 master copies and the inner optimizer's state.

    Attributes:
      master: the parameters' float32 copies where a parameter is narrower (float16,
        bfloat16), ``None`` at every other leaf (a float32 parameter is its own master).
      inner_state: the inner transformation's state (it runs on the master copies).
    """

    master: optax.Params
    inner_state: optax.OptState


#: The states whose ``loss_scale`` field is the ``LossScaleState`` of a transformation.
OWNER_TYPES: tuple[type, ...] = (
    LossScalingState,
    LossScalingMultiStepsState,
    LayerwiseScalingState,
)


class StepOutcome(NamedTuple):
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


def step_outcome(owner: Any) -> StepOutcome | None:
    """What the update that produced ``owner`` (a state of ``OWNER_TYPES``) did.

    Rule::

      LossScalingState:           completed = True
                                  applied   = not last_skipped
                                  discard   = last_skipped
      LossScalingMultiStepsState: completed = mini_step == 0         # a window just ended
                                  applied   = completed and not last_skipped
                                  discard   = window_overflow        # sticky: from the first
                                              or (completed and last_skipped)  # bad micro-batch
                                                                     # to the window's end

    In a skipped window, the collections written by the micro-batches before
    the first overflowing one persist (their forward passes were good; only
    the optimizer step is skipped); from that micro-batch to the window's end
    nothing persists. ``None`` for anything else (a bare ``LossScaleState``).
    """
    if isinstance(owner, LayerwiseScalingState) and owner.window is not None:
        skipped = owner.loss_scale.last_skipped
        ended = owner.window.mini_step == 0
        return StepOutcome(
            completed=ended,
            applied=jnp.logical_and(ended, jnp.logical_not(skipped)),
            discard=jnp.logical_or(owner.window.overflow, jnp.logical_and(ended, skipped)),
        )
    if isinstance(owner, LossScalingState | LayerwiseScalingState):
        skipped = owner.loss_scale.last_skipped
        return StepOutcome(jnp.ones([], jnp.bool_), jnp.logical_not(skipped), skipped)
    if isinstance(owner, LossScalingMultiStepsState):
        skipped = owner.loss_scale.last_skipped
        ended = owner.mini_step == 0
        return StepOutcome(
            completed=ended,
            applied=jnp.logical_and(ended, jnp.logical_not(skipped)),
            discard=jnp.logical_or(owner.window_overflow, jnp.logical_and(ended, skipped)),
        )
    return None
