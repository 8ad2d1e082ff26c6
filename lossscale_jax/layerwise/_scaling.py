"""``layerwise_scaling``: the factory that validates, builds the engine and wraps the step.

The step's stages are ``_step.LayerwiseStep``'s; the layer map is ``_map``'s.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax

from lossscale_jax.engine import _check
from lossscale_jax.engine._engine import Engine, EngineUpdate
from lossscale_jax.engine._hyper import check_int
from lossscale_jax.engine._nesting import prepare_inner
from lossscale_jax.layerwise._map import LayerMap
from lossscale_jax.layerwise._step import LayerwiseStep
from lossscale_jax.policies import HeadroomScale


def layerwise_scaling(
    inner: optax.GradientTransformation,
    layers: LayerMap,
    policy: HeadroomScale | None = None,
    *,
    overflow: _check.OverflowMode = "ieee",
    compute_dtype: Any = jnp.float16,
    axis_name: Any = None,
    local_axes: Any = None,
    on_stuck: str = "skip",
    attribution: str | None = "reduced",
    every_k: int = 1,
    check_wiring: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` with per-layer loss scaling: one scale per segment, one skip decision.

    Rule (one ``update``; ``C`` the segments' scales, ``n`` layer taps)::

      check = per-leaf flags and max |g|, each against its segment's C; each layer tap's
              range against the scale it was measured at (C[j + 1]) counts for segments
              j and j + 1, its inf/nan for segment j + 1; one all-reduce over axis_name
      overflow = any segment overflowed
      culprit = the overflowed segment closest to the loss (upstream ones inherit its inf)
      for each segment s:                          # HeadroomScale's rule, per segment
          if overflow and s == culprit: adjust(s, overflow=True)    # margin +1, scale down
          elif overflow:                keep s as it was
          else:                         adjust(s, overflow=False, amax=check.amax[s])
      loss_scale = record the step (scale C[n], skipped = overflow)
      if not overflow: updates = inner.update(g / C[segment of each leaf])
      else:            updates = -0.0, inner state unchanged

    Args:
      inner: any Optax transformation (it sees unscaled gradients).
      layers: the ``LayerMap`` of ``discover``.
      policy: the per-segment rule's hyperparameters, a ``HeadroomScale`` (default
        ``HeadroomScale()``); ``init_scale`` starts every segment.
      overflow, compute_dtype, axis_name, local_axes, on_stuck, attribution: as
        ``loss_scaling``.
      every_k: micro-batches per optimizer step (accumulation, as
        ``loss_scaling_multi_steps``: the scales are constant within a window, each
        micro-batch is checked and folded into the window's check, an overflowing one is
        left out of the sum, and the rule runs once at the window's end).

      check_wiring: ``False`` turns the wiring check off for this transformation (the
        check that refuses, while the step is traced, gradients ``update`` must not divide
        by the scale; docs/errors.md). ``lsj.no_wiring_check()`` turns it off for a block.
    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update`` takes ``taps=``
      (required: the ``TapStats`` of ``lsj.layerwise.value_and_grad``); ``apply_gradients``
      runs it fused.
    """
    if policy is None:
        policy = HeadroomScale()
    if not isinstance(policy, HeadroomScale):
        raise TypeError(
            "layerwise_scaling adapts each layer by HeadroomScale's rule: pass "
            f"policy=HeadroomScale(...), got {type(policy).__name__}."
        )
    if not isinstance(layers, LayerMap):
        raise TypeError(
            f"layers must be the LayerMap lsj.layerwise.discover returns, got {layers!r}."
        )
    engine = Engine.build(
        "layerwise_scaling",
        policy,
        overflow=overflow,
        compute_dtype=compute_dtype,
        axis_name=axis_name,
        local_axes=local_axes,
        on_stuck=on_stuck,
        attribution=attribution,
        check_wiring=check_wiring,
    )
    every_k = check_int("every_k", every_k, 1)
    run = LayerwiseStep(engine, prepare_inner(inner, "layerwise_scaling"), policy, layers, every_k)

    fusable = every_k == 1  # with accumulation: the Optax path (tx.update), as multi-steps
    update = EngineUpdate(
        run.update,
        engine,
        run.inner,
        fusable=fusable,
        fused_step=run.fused if fusable else None,
        not_fusable_because=None
        if fusable
        else (
            f"lossscale_jax.apply_gradients does not take layerwise_scaling(..., "
            f"every_k={every_k}): with accumulation a call ends a window only every "
            f"{every_k} micro-batches, so there is no fused step to run. Use the Optax path: "
            "updates, opt_state = tx.update(grads, opt_state, params, taps=taps); params = "
            "optax.apply_updates(params, updates) (TrainState.apply_gradients does this)."
        ),
    )
    return optax.GradientTransformationExtraArgs(run.init, update)  # pyright: ignore
