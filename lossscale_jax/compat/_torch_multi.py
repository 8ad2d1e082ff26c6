"""``compat.torch.multi_optimizer``: one ``GradScaler`` stepping several optimizers.

Re-exported by ``compat.torch``; a front-end on the engine like ``loss_scaling``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from lossscale_jax import numerics
from lossscale_jax.compat._common import _check_policy
from lossscale_jax.engine._devices import AxisName
from lossscale_jax.engine._engine import (
    Engine,
    EngineUpdate,
    check_state,
)
from lossscale_jax.engine._inner_skip import inner_or_skip
from lossscale_jax.engine._landing import check_landing, float16_leaves, warn_float16_inner
from lossscale_jax.engine._nesting import prepare_inner, refuse_nested_state
from lossscale_jax.engine._opt_states import LossScalingState
from lossscale_jax.engine._unscale import scale_is_bad
from lossscale_jax.policies import LossScalePolicy

__all__ = ["multi_optimizer"]


def multi_optimizer(
    transforms: Mapping[Hashable, optax.GradientTransformation],
    param_labels: Any | Callable[[Any], Any],
    grad_scaler: LossScalePolicy,
    *,
    overflow: numerics.OverflowMode = "ieee",
    compute_dtype: Any = jnp.float16,
    axis_name: AxisName | None = None,
    on_stuck: str = "skip",
    attribution: str | None = "reduced",
) -> optax.GradientTransformationExtraArgs:
    """One ``GradScaler`` stepping several optimizers, as torch does.

    In torch, ``scaler.step(opt0); scaler.step(opt1); scaler.update()``
    skips only the optimizer whose own gradients held an inf or nan, steps
    the others, and backs the one scale off if any of them overflowed. This
    is that step over the partitions of ``optax.multi_transform``.

    Rule (one ``update``; the gradients are those of ``scale_loss(loss, state)``)::

      flags = one overflow flag per leaf, ORed over axis_name    # one all-reduce
      found[k] = any(flags of the leaves labelled k)
      loss_scale = grad_scaler.adjust(loss_scale, any(found))
      for each label k:
          if found[k] and loss_scale.last_skipped: -0.0 for k, k's state kept
          else: updates for k, state = transforms[k].update(grads[k] / scale, ...)

    The step is the engine's, as for ``loss_scaling``: the same check, the same
    collective, the same policy step, the same conditional (one per label).

    ``metrics(opt_state)["skipped"]`` is True when any optimizer skipped.
    One ``loss_scaling`` around ``optax.multi_transform`` instead skips every
    partition together (one decision for the whole model), which is what
    the other frameworks do; choose that unless you port a torch recipe.

    Args:
      transforms: label -> optax transformation (torch's optimizers).
      param_labels: a pytree of labels (a prefix of the params) or a function
        of the params returning one, as for ``optax.multi_transform``.
      grad_scaler: the policy, e.g. ``compat.torch.GradScaler(...)``.
      overflow: the overflow check (``"ieee"``, torch's).
      compute_dtype: the dtype of the backward pass.
      axis_name: ``pmap``/``shard_map`` axis over which the per-leaf flags are
        reduced (one all-reduce of ``n_leaves + 1`` values), so every device takes
        the same decision for every label.
      on_stuck: ``"skip"`` or ``"error"`` (see ``loss_scaling``).
      attribution: ``"reduced"`` (default) keeps the per-leaf record
        (``overflowed_leaves``, ``metrics``); ``None`` keeps none. The flags
        are always reduced over ``axis_name`` (the decisions need them), so
        ``"local"`` is refused.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      ``LossScalingState`` (``scale_loss``, ``metrics`` work on it).

    Raises:
      TypeError: if ``transforms`` is not a non-empty mapping or ``grad_scaler`` not a
        policy. ValueError: for a bad ``overflow``, ``axis_name``, ``on_stuck`` or
        ``attribution``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> from lossscale_jax import compat
      >>> params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
      >>> tx = compat.torch.multi_optimizer(
      ...     {"a": optax.sgd(1.0), "b": optax.sgd(1.0)}, {"a": "a", "b": "b"},
      ...     compat.torch.GradScaler(init_scale=4.0))
      >>> grads = {"a": jnp.array([4.0, 8.0]), "b": jnp.array([jnp.inf, 0.0])}
      >>> updates, state = tx.update(grads, tx.init(params), params)
      >>> updates["a"].tolist(), updates["b"].tolist(), float(state.loss_scale.scale)
      ([-1.0, -2.0], [-0.0, -0.0], 2.0)
    """
    if attribution == "local":
        raise ValueError(
            "attribution='local' is not available for multi_optimizer: its per-partition "
            "decisions read the flags of every device, so the record is always reduced. Pass "
            "attribution='reduced' (default) or None."
        )
    engine = Engine.build(
        "compat.torch.multi_optimizer",
        _check_policy("grad_scaler", grad_scaler),
        overflow=overflow,
        compute_dtype=compute_dtype,
        axis_name=axis_name,
        on_stuck=on_stuck,
        attribution=attribution,
        policy_name="grad_scaler",
    )
    if not isinstance(transforms, Mapping) or not transforms:
        raise TypeError(
            f"transforms must be a non-empty mapping of label -> optax transformation, got "
            f"{transforms!r}."
        )
    inners = {k: prepare_inner(t, "compat.torch.multi_optimizer") for k, t in transforms.items()}

    def partition(applies: Mapping[Hashable, jax.Array], scale: Any) -> Any:
        """``optax.multi_transform`` of the inner transformations, each skipped unless
        ``applies[label]`` (``init`` reads neither: ``partition({}, None).init``)."""

        def own(label: Hashable, inner: Any) -> optax.GradientTransformationExtraArgs:
            def update_fn(updates, state, params=None, **extra_args):
                def inner_update(g: Any, inner_state: Any) -> Any:
                    g = engine.unscale(g, scale, params)
                    return inner.update(g, inner_state, params, **extra_args)

                return inner_or_skip(engine, applies[label], inner_update, updates, state)

            return optax.GradientTransformationExtraArgs(inner.init, update_fn)

        return optax.multi_transform({k: own(k, t) for k, t in inners.items()}, param_labels)

    def init_fn(params: optax.Params) -> LossScalingState:
        inner_state = partition({}, None).init(params)
        refuse_nested_state(inner_state, "compat.torch.multi_optimizer")
        warn_float16_inner(params, inner_state, "compat.torch.multi_optimizer")
        return LossScalingState(
            loss_scale=engine.policy.init(),
            inner_state=inner_state,
            leaf_overflow=engine.empty_record(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        state = check_state(state, LossScalingState, "compat.torch.multi_optimizer")
        scale = state.loss_scale.scale
        taps = extra_args.pop("taps", None)  # the engine reads them; the inner never sees them
        check = engine.check(updates, scale, state.leaf_overflow, reduce_flags=True, taps=taps)
        if float16_leaves(params):  # where every update would land: a leaf it cannot land in
            every = {k: jnp.ones([], jnp.bool_) for k in transforms}
            landed, _ = partition(every, scale).update(
                updates, state.inner_state, params, **extra_args
            )
            check = check_landing(engine, check, params, landed, scale, reduce_flags=True)
        loss_scale, _ = engine.decide(state.loss_scale, check)
        flags = cast(jax.Array, check.flags)  # reduce_flags=True: always kept
        # A partition is skipped for its own overflow or an update of its own that cannot land.
        blocked = flags if check.unlanded_flags is None else flags | check.unlanded_flags
        labels = param_labels(updates) if callable(param_labels) else param_labels
        per_leaf = jax.tree_util.tree_leaves(
            jax.tree_util.tree_map(
                lambda lab, sub: jax.tree_util.tree_map(lambda _: lab, sub), labels, updates
            )
        )
        bad_scale = scale_is_bad(scale)
        applies = {}
        for k in transforms:
            mine = [i for i, lab in enumerate(per_leaf) if lab == k]
            found = jnp.logical_or(jnp.any(blocked[jnp.asarray(mine, jnp.int32)]), bad_scale)
            applies[k] = jnp.logical_not(jnp.logical_and(found, loss_scale.last_skipped))
        new_updates, inner_state = partition(applies, scale).update(
            updates, state.inner_state, params, **extra_args
        )
        record = flags if engine.attribution is not None else None
        return new_updates, LossScalingState(loss_scale, inner_state, record)

    # leaf_overflow may be None (no record): a leafless pytree optax's OptState alias omits.
    return optax.GradientTransformationExtraArgs(
        init_fn,  # pyright: ignore[reportArgumentType]
        EngineUpdate(update_fn, engine, partition({}, None)),
    )
