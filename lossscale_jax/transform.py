"""The Optax transformation and the functions that read its state."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.typing import ArrayLike

from lossscale_jax import numerics, stuck
from lossscale_jax.policies import LossScalePolicy, LossScaleState

AxisName = Hashable | Sequence[Hashable]


class LossScalingState(NamedTuple):
    """State of :func:`loss_scaling`: the loss-scale state and the inner state."""

    loss_scale: LossScaleState
    inner_state: optax.OptState


class _LossScalingParts(NamedTuple):
    """The pieces of one ``loss_scaling`` update, for the fused step.

    ``inner`` is the wrapped transformation (with extra-args support);
    ``decide(scaled_grads, loss_scale) -> (loss_scale, apply)`` checks the
    scaled gradients, reduces the flag across devices and adjusts the scale.
    """

    inner: optax.GradientTransformationExtraArgs
    decide: Any


def _validate_axis_name(axis_name: Any) -> tuple[Hashable, ...] | None:
    if axis_name is None:
        return None
    names = tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)
    if not names:
        raise ValueError("axis_name must be a name or a non-empty tuple of names, got ().")
    for n in names:
        if n is None or not isinstance(n, Hashable) or isinstance(n, bool):
            raise TypeError(
                f"axis_name must be a hashable name or a tuple of names, got {axis_name!r}."
            )
    return names


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
    axes = names[0] if len(names) == 1 else names
    try:
        return lax.pmax(flag.astype(jnp.int32), axes) > 0
    except NameError as e:
        raise ValueError(
            f"axis_name={axis_name!r} is not bound here: run the update inside jax.pmap or "
            "jax.shard_map over that axis, or pass axis_name=None (one device, or jit over "
            f"sharded arrays, where XLA reduces the flag). JAX said: {e}"
        ) from e


def loss_scaling(
    inner: optax.GradientTransformation,
    policy: LossScalePolicy,
    *,
    overflow: numerics.OverflowMode = "ieee",
    compute_dtype: Any = jnp.float16,
    axis_name: AxisName | None = None,
    on_stuck: str = "skip",
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` with loss scaling: unscale, check, adjust, skip on overflow.

    Rule (one ``update``)::

      grads, overflow = unscale_and_check(scaled_grads, scale, params)
      overflow = any(overflow over axis_name)          # one scalar collective
      loss_scale = policy.adjust(loss_scale, overflow)
      if not loss_scale.last_skipped:                   # lax.cond, good branch first
          updates, inner_state = inner.update(grads, inner_state, params)
      else:
          updates, inner_state = zeros, inner_state     # e.g. Adam's count unchanged

    The gradients given to ``update`` are the gradients of
    ``scale_loss(loss, opt_state)``; ``inner`` sees the unscaled gradients,
    in the dtype of their parameters when ``params`` is passed.

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

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

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
    _validate_axis_name(axis_name)
    on_stuck = stuck.validate_on_stuck(on_stuck)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> LossScalingState:
        return LossScalingState(loss_scale=policy.init(), inner_state=inner.init(params))

    def decide(
        updates: optax.Updates, loss_scale: LossScaleState
    ) -> tuple[LossScaleState, jax.Array]:
        """The adjusted loss-scale state and whether to apply the update."""
        # One read of the scaled gradients; the unscale happens inside the
        # conditional, fused with the inner update (no unscaled copy is
        # written to memory).
        found = numerics.check_overflow(updates, mode, compute_dtype)
        found = reduce_overflow(found, axis_name)
        loss_scale = policy.adjust(loss_scale, found)
        stuck.check_stuck(loss_scale, on_stuck)
        return loss_scale, jnp.logical_not(loss_scale.last_skipped)

    def update_fn(
        updates: optax.Updates,
        state: LossScalingState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScalingState]:
        if not isinstance(state, LossScalingState):
            raise TypeError(
                "state must be the LossScalingState made by this transformation's init, got "
                f"{type(state).__name__} (an optimizer state without loss scaling?)."
            )
        loss_scale, apply = decide(updates, state.loss_scale)
        scale = state.loss_scale.scale

        def apply_inner(operands):
            g, inner_state = operands
            g = numerics.unscale(g, scale, params)
            return inner.update(g, inner_state, params, **extra_args)

        out_shapes = jax.eval_shape(apply_inner, (updates, state.inner_state))[0]

        def skip(operands):
            _, inner_state = operands
            zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), out_shapes)
            return zeros, inner_state

        # Good branch first: XLA:CPU inserts fewer copies for this order.
        new_updates, inner_state = lax.cond(apply, apply_inner, skip, (updates, state.inner_state))
        return new_updates, LossScalingState(loss_scale=loss_scale, inner_state=inner_state)

    # What `lossscale_jax.apply_gradients` needs to run the same step fused.
    update_fn.loss_scaling_parts = _LossScalingParts(inner=inner, decide=decide)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _is_loss_scale_state(x: Any) -> bool:
    return isinstance(x, LossScaleState)


def get_loss_scale_state(opt_state: Any) -> LossScaleState:
    """Finds the one ``LossScaleState`` in an optimizer state.

    Works on a bare ``LossScaleState``, on the state of ``loss_scaling``, and
    on a state in which that sits inside ``optax.chain``, ``optax.MultiSteps``,
    ``optax.inject_hyperparams`` or any other pytree.

    Raises:
      ValueError: if ``opt_state`` holds no ``LossScaleState`` or more than one.
    """
    if isinstance(opt_state, LossScaleState):
        return opt_state
    found = [
        x
        for x in jax.tree_util.tree_leaves(opt_state, is_leaf=_is_loss_scale_state)
        if isinstance(x, LossScaleState)
    ]
    if len(found) == 1:
        return found[0]
    if not found:
        raise ValueError(
            "opt_state contains no LossScaleState: build the optimizer with "
            "lossscale_jax.loss_scaling(...) and pass its state (or the LossScaleState)."
        )
    raise ValueError(
        f"opt_state contains {len(found)} LossScaleStates; pass the one you mean "
        "(e.g. get it from the inner state yourself)."
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

    Keys: ``loss_scale`` (float32), ``overflow``, ``skipped`` and ``stuck``
    (bool, the last step; ``stuck``: it overflowed with the scale already at
    its floor), ``total_steps``, ``overflow_steps``, ``skipped_steps``
    (int32) and ``overflow_rate`` (float32, ``overflow_steps / total_steps``,
    0 before the first step). Keep ``overflow_rate`` under 0.5%.
    """
    s = get_loss_scale_state(opt_state)
    total = s.total_steps.astype(jnp.float32)
    rate = jnp.where(total > 0, s.overflow_steps.astype(jnp.float32) / jnp.maximum(total, 1.0), 0.0)
    return {
        "loss_scale": s.scale,
        "overflow": s.last_overflow,
        "skipped": s.last_skipped,
        "stuck": s.stuck,
        "total_steps": s.total_steps,
        "overflow_steps": s.overflow_steps,
        "skipped_steps": s.skipped_steps,
        "overflow_rate": rate.astype(jnp.float32),
    }
