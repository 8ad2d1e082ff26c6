"""The fused step: check, unscale, update and apply inside one conditional."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from lossscale_jax.engine._engine import check_state, engine_of
from lossscale_jax.engine._landing import land_first, unscale_targets
from lossscale_jax.engine._opt_states import LossScalingState
from lossscale_jax.engine._unscale import inverse

__all__ = ["apply_gradients"]


def apply_gradients(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: LossScalingState,
    params: optax.Params,
    **extra_args: Any,
) -> tuple[optax.Params, LossScalingState]:
    """One loss-scaled optimizer step with the update applied inside the skip conditional.

    The same step as ``tx.update`` followed by ``optax.apply_updates`` (bit
    for bit on XLA:CPU; a GPU compiles each on its own, and may contract a
    multiply and an add differently: 1 float32 ulp was seen), without
    materialising the update tree: on a good step the inner update and
    ``params + updates`` run in one branch that XLA fuses, so the scaler costs
    about one extra read of the gradients (the overflow check).

    Rule::

      overflow = any(overflow(grads)) over axis_name     # one read of grads
      loss_scale = policy.adjust(loss_scale, overflow)
      if not loss_scale.last_skipped:                    # one lax.cond (GPU: a select)
          updates, inner_state = inner.update(grads / scale, inner_state, params)
          params = optax.apply_updates(params, updates)
      # else: params and inner_state are returned as they were

    Call it inside your jitted step and donate ``params`` and ``opt_state``
    (``jax.jit(step, donate_argnums=...)``) so the update happens in place.
    On a skipped step the parameters come back untouched, as on the Optax
    path (whose ``-0.0`` updates leave every parameter bit-identical).

    Args:
      tx: the transformation returned by ``lossscale_jax.loss_scaling`` (not
        wrapped in another transformation).
      grads: the gradients of ``scale_loss(loss, opt_state)``.
      opt_state: ``tx``'s state.
      params: the parameters (e.g. float32 master weights).
      **extra_args: passed to the inner transformation's ``update``, except
        ``taps=``: the ``TapStats`` of the backward pass
        (``lsj.taps.value_and_grad``), which the check reads (an inf or nan in a
        tapped cotangent is an overflow; ``HeadroomScale`` keeps room for the range
        they show).

    Returns:
      ``(new_params, new_opt_state)``.

    Raises:
      TypeError: if ``tx`` was not built by ``loss_scaling`` (a ``loss_scaling``
        inside ``optax.chain`` or ``loss_scaling_multi_steps`` runs on the Optax path:
        ``tx.update`` + ``optax.apply_updates``), or ``opt_state`` is not its state.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> tx = lsj.loss_scaling(optax.sgd(0.1), lsj.StaticScale(2.0**10))
      >>> params = {"w": jnp.ones(3)}
      >>> opt_state = tx.init(params)
      >>> grads = jax.grad(lambda p: lsj.scale_loss(jnp.sum(p["w"] ** 2), opt_state))(params)
      >>> params, opt_state = jax.jit(lsj.apply_gradients, static_argnums=0)(
      ...     tx, grads, opt_state, params)
      >>> params["w"]
      Array([0.8, 0.8, 0.8], dtype=float32)
    """
    built = engine_of(tx)
    if built is None or not built.fusable:
        if built is not None and built.not_fusable_because is not None:
            raise TypeError(f"{built.not_fusable_because} Got {tx!r}.")
        raise TypeError(
            "tx must be the transformation returned by lossscale_jax.loss_scaling(...) "
            f"itself (not wrapped in optax.chain, MultiSteps, ...), got {tx!r}. Wrapped "
            "transformations run on the Optax path: tx.update + optax.apply_updates."
        )
    engine, inner = built.engine, built.inner
    if built.fused_step is not None:  # a front-end with a fused step of its own
        return built.fused_step(grads, opt_state, params, **extra_args)
    state = check_state(opt_state, LossScalingState, "apply_gradients")
    scale = state.loss_scale.scale
    taps = extra_args.pop("taps", None)  # the engine reads them; the inner never sees them
    check = engine.check(grads, scale, state.leaf_overflow, taps=taps)
    targets = unscale_targets(params, state.inner_state)

    def inner_update(g: Any, inner_state: Any, p: Any = params) -> Any:
        return inner.update(engine.unscale(g, scale, targets), inner_state, p, **extra_args)

    # float16 parameters: the update is computed first, and where it lands is checked.
    check, landed = land_first(engine, check, params, inner_update, grads, state.inner_state, scale)
    loss_scale, apply = engine.decide(state.loss_scale, check)

    # ``neg_zero`` is -0.0 whenever the good branch's result is used, but XLA cannot know
    # it. Adding it to the updates (exact: u + -0.0 == u, signs of zeros included) ends each
    # update's expression with an addition, so a backend that contracts ``p + a * b`` into a
    # fused multiply-add (XLA:CPU does) still adds the rounded update: the result is
    # bit-identical to the Optax path, where the updates cross the conditional's boundary in
    # memory. It is a product with the unscale's factor (1 / scale, finite and > 0 whenever
    # the step applies: a scale that is not counts as an overflow), computed in the good
    # branch beside the unscale's own (XLA computes the two as one): no kernel of its own,
    # on any backend (a select on ``apply`` outside the branch was one on XLA:CPU).

    def good(operands: Any) -> Any:
        g, inner_state, p = operands
        neg_zero = jnp.float32(-0.0) * inverse(scale)
        updates, inner_state = landed(g, inner_state, p)
        updates = jax.tree_util.tree_map(lambda u: u + neg_zero.astype(u.dtype), updates)
        return optax.apply_updates(p, updates), inner_state

    def skip(operands: Any) -> Any:
        _, inner_state, p = operands
        return p, inner_state

    new_params, inner_state = engine.select(apply, good, skip, (grads, state.inner_state, params))
    return new_params, LossScalingState(loss_scale, inner_state, check.flags)
