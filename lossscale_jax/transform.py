"""``loss_scaling``: the Optax transformation (the front-end most users call).

It unscales, checks, adjusts the scale and applies the inner transformation only on a
good step; the step itself is the engine's (``engine/_engine.py``). The functions that read
and change its state are re-exported here, where they were first documented.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax

from lossscale_jax import numerics
from lossscale_jax.access._access import (
    get_loss_scale_state,
    scale_loss,
    set_loss_scale_state,
    switch_policy,
)
from lossscale_jax.access._metrics import metrics, overflowed_leaves
from lossscale_jax.engine._devices import AxisName, reduce_overflow
from lossscale_jax.engine._engine import (
    ATTRIBUTIONS,
    Engine,
    EngineUpdate,
    check_state,
    validate_attribution,
)
from lossscale_jax.engine._inner_skip import inner_or_skip
from lossscale_jax.engine._landing import land_first, unscale_targets, warn_float16_inner
from lossscale_jax.engine._nesting import prepare_inner, refuse_nested_state
from lossscale_jax.engine._opt_states import LossScalingState
from lossscale_jax.engine._wiring import no_wiring_check
from lossscale_jax.policies import LossScalePolicy

__all__ = [
    "ATTRIBUTIONS",
    "AxisName",
    "LossScalingState",
    "get_loss_scale_state",
    "loss_scaling",
    "metrics",
    "no_wiring_check",
    "overflowed_leaves",
    "reduce_overflow",
    "scale_loss",
    "set_loss_scale_state",
    "switch_policy",
    "validate_attribution",
]


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
    check_wiring: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` with loss scaling: unscale, check, adjust, skip on overflow.

    Rule (one ``update``)::

      flags = overflow_flags(scaled_grads)             # one per leaf; one read of the grads
      overflow = any(flags) over axis_name              # one collective
      leaf_overflow = flags                             # (ORed over axis_name if "reduced")
      loss_scale = policy.adjust(loss_scale, overflow)
      if not loss_scale.last_skipped:                   # lax.cond (a select on a GPU)
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

    ``update`` also takes ``taps=``, the ``TapStats`` of the backward pass
    (``lsj.taps.value_and_grad``): an inf or nan in a tapped cotangent (the loss,
    an activation) counts as an overflow, and a policy that measures the range
    (``HeadroomScale``) keeps room for the taps' range too, reduced over
    ``axis_name`` in the flag's own collective. The inner transformation does not
    see them.

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
      policy: a policy instance: ``NoScale()``, ``StaticScale(...)``,
        ``DynamicScale(...)``, ``TolerantDynamicScale(...)``, ``HeadroomScale(...)``.
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

      check_wiring: ``False`` turns the wiring check off for this transformation (the
        check that refuses, while the step is traced, gradients ``update`` must not divide
        by the scale; docs/errors.md). ``lsj.no_wiring_check()`` turns it off for a block.
    Returns:
      An ``optax.GradientTransformationExtraArgs`` (which ``apply_gradients``
      can also run fused).

    Raises:
      TypeError, ValueError: for a bad argument (a policy class instead of an
        instance is ``errors.NotAPolicyError``).
      errors.NestingError: when ``inner`` is itself a loss-scaling transformation
        (it would unscale twice).

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
    engine = Engine.build(
        "loss_scaling",
        policy,
        overflow=overflow,
        compute_dtype=compute_dtype,
        axis_name=axis_name,
        local_axes=local_axes,
        on_stuck=on_stuck,
        attribution=attribution,
        check_wiring=check_wiring,
    )
    inner = prepare_inner(inner, "loss_scaling")

    def init_fn(params: optax.Params) -> LossScalingState:
        inner_state = inner.init(params)
        refuse_nested_state(inner_state, "loss_scaling")
        warn_float16_inner(params, inner_state, "loss_scaling")
        return LossScalingState(
            loss_scale=engine.policy.init(),
            inner_state=inner_state,
            leaf_overflow=engine.empty_record(params),
        )

    def update_fn(
        updates: optax.Updates,
        state: Any,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScalingState]:
        state = check_state(state, LossScalingState, "loss_scaling")
        # One read of the scaled gradients (the per-leaf flags are the check's own
        # results); the unscale happens inside the conditional, fused with the inner
        # update (no unscaled copy is written to memory).
        scale = state.loss_scale.scale
        taps = extra_args.pop("taps", None)  # the engine reads them; the inner never sees them
        check = engine.check(updates, scale, state.leaf_overflow, taps=taps)
        targets = unscale_targets(params, state.inner_state)

        def inner_update(g: Any, inner_state: Any) -> Any:
            g = engine.unscale(g, scale, targets)
            return inner.update(g, inner_state, params, **extra_args)

        # float16 parameters: the update is computed first, and where it lands is checked.
        check, inner_update = land_first(
            engine, check, params, inner_update, updates, state.inner_state, scale
        )
        loss_scale, apply = engine.decide(state.loss_scale, check)
        new_updates, inner_state = inner_or_skip(
            engine, apply, inner_update, updates, state.inner_state, like=params
        )
        return new_updates, LossScalingState(loss_scale, inner_state, check.flags)

    # leaf_overflow may be None (no record): a leafless pytree optax's OptState alias omits.
    return optax.GradientTransformationExtraArgs(
        init_fn,  # pyright: ignore[reportArgumentType]
        EngineUpdate(update_fn, engine, inner, fusable=True),
    )
