"""Flax integration: train states whose step does not advance on a skipped step.

``TrainState`` subclasses Flax Linen's ``flax.training.train_state.TrainState``;
``LossScaleOptimizer`` subclasses Flax NNX's ``nnx.Optimizer``. Both apply the
gradients through a ``loss_scaling`` (or ``loss_scaling_multi_steps``)
transformation and read what the update did from the new optimizer state
(``step_outcome``): whether an optimizer step completed, whether
it was applied, and whether this call's model collections must be discarded.

Mixed precision itself is Flax's own: build the model with
``param_dtype=jnp.float32`` (master weights) and ``dtype=jnp.float16``
(compute); the gradients then come back in float32, computed in float16.
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from flax.training import train_state

from lossscale_jax.access._rollback import keep_where, outcome
from lossscale_jax.engine._engine import engine_of
from lossscale_jax.engine._ops import where
from lossscale_jax.engine._opt_states import (
    LayerwiseScalingState,
    LossScalingState,
    StepOutcome,
)
from lossscale_jax.errors import NestingError, StateNotFoundError
from lossscale_jax.fused import apply_gradients

# The states of transformations apply_gradients runs fused.
FUSED_STATES = (LossScalingState, LayerwiseScalingState)

__all__ = ["LossScaleOptimizer", "TrainState"]


def _check_loss_scaled(opt_state: Any, where: str) -> None:
    try:
        outcome(opt_state)
    except StateNotFoundError as e:
        raise StateNotFoundError(
            f"{where}: tx must contain exactly one lossscale_jax.loss_scaling(...) "
            f"or loss_scaling_multi_steps(...) transformation ({e})"
        ) from None
    except NestingError as e:
        raise NestingError(f"{where}: {e}") from None


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__}).")
    return value


def _apply(tx: optax.GradientTransformation, grads, opt_state, params, **extra_args):
    """One optimizer step; returns ``(new_params, new_opt_state, outcome)``.

    The fused ``apply_gradients`` when ``tx`` is ``loss_scaling(...)`` itself; the Optax
    path (``tx.update`` + ``optax.apply_updates``) when it is wrapped (``optax.chain``,
    ``MultiSteps``, ...) or another front-end. Both give bit-identical parameters.
    """
    built = engine_of(tx)
    if built is not None and built.fusable and isinstance(opt_state, FUSED_STATES):
        new_params, new_opt_state = apply_gradients(
            tx, grads, cast(Any, opt_state), params, **extra_args
        )
    else:
        updates, new_opt_state = tx.update(grads, opt_state, params, **extra_args)
        new_params = optax.apply_updates(params, updates)
    return new_params, new_opt_state, outcome(new_opt_state)


def _advance(step: Any, outcome: StepOutcome, count_skipped: bool) -> jax.Array:
    """``step + 1`` for each applied update (each completed one if ``count_skipped``)."""
    step = jnp.asarray(step)
    one = jnp.ones([], step.dtype)
    counts = outcome.completed if count_skipped else outcome.applied
    return where(counts, step + one, step)


class TrainState(train_state.TrainState):
    """A Flax Linen ``TrainState`` for loss-scaled training.

    Rule (``apply_gradients(grads=g, **collections)``)::

      params, opt_state = lsj.apply_gradients(tx, g, opt_state, params)
      completed, applied, discard = what the update did (see below)
      step = step + 1 if (completed if count_skipped_steps else applied)
      for name, new in collections:                 # e.g. batch_stats
          name = old if (discard and rollback_on_skip) else new

    With ``tx = loss_scaling(...)`` every call completes a step; it is applied
    unless skipped, and a skipped step's collections are discarded. With
    ``tx = loss_scaling_multi_steps(..., every_k=k)`` a step completes on the
    last micro-batch of each window, so ``step`` counts applied windows
    (optimizer updates), and the collections are discarded from the window's
    first overflowing micro-batch to its end (those written before it, by
    good forward passes, persist).

    The fused step ``lsj.apply_gradients`` runs when ``tx`` is a bare
    ``loss_scaling(...)``; otherwise (``loss_scaling_multi_steps``, or
    ``optax.chain(loss_scaling(...))``) the Optax path, ``tx.update`` +
    ``optax.apply_updates``, with bit-identical results. On a skipped step
    ``params`` and the inner optimizer state do not change either. The
    default does not advance ``step`` (what Ascend's ``NPULossScaleOptimizer``
    does), so a learning-rate schedule indexed by ``step`` does not move on a
    discarded step. ``batch_stats`` is a field (``None`` unless given) for
    models with BatchNorm; subclass to add other collections.

    Attributes:
      batch_stats: the ``batch_stats`` collection, or ``None``.
      count_skipped_steps: advance ``step`` on every completed step, skipped
        ones included (static, default ``False``); under accumulation it then
        counts windows.
      rollback_on_skip: keep the previous value of every collection passed to
        ``apply_gradients`` when the call's collections are discarded (static,
        default ``True``: the running statistics of an overflowed forward pass
        may hold inf).

    Examples:
      >>> import jax, jax.numpy as jnp, optax, flax.linen as nn
      >>> import lossscale_jax as lsj
      >>> model = nn.Dense(2, dtype=jnp.float16, param_dtype=jnp.float32)
      >>> params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
      >>> tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=2.0**10))
      >>> state = lsj.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
      >>> bad = jax.tree_util.tree_map(lambda p: jnp.full_like(p, jnp.inf), params)
      >>> int(state.apply_gradients(grads=bad).step)     # skipped: step stays
      0
    """

    batch_stats: Any = None
    count_skipped_steps: bool = struct.field(pytree_node=False, default=False)
    rollback_on_skip: bool = struct.field(pytree_node=False, default=True)

    def apply_gradients(self, *, grads: Any, taps: Any = None, **kwargs: Any) -> TrainState:
        """Applies the (scaled) gradients; ``step`` counts applied updates.

        Args:
          grads: gradients of ``lsj.scale_loss(loss, state.opt_state)``, same
            structure as ``params``.
          taps: the ``TapStats`` of the backward pass (``lsj.taps.value_and_grad``),
            read by the overflow check (see ``loss_scaling``); ``None``: none.
          **kwargs: other fields to replace, e.g. ``batch_stats`` from the
            forward pass; rolled back when the call's collections are
            discarded and ``rollback_on_skip``.

        Returns:
          The new state.
        """
        extra = {} if taps is None else {"taps": taps}
        new_params, new_opt_state, outcome = _apply(
            self.tx, grads, self.opt_state, self.params, **extra
        )
        if self.rollback_on_skip:
            pytree_fields = {
                f.name
                for f in self.__dataclass_fields__.values()
                if f.metadata.get("pytree_node", True)
            }
            kwargs = {
                k: keep_where(k, outcome.discard, getattr(self, k), v) if k in pytree_fields else v
                for k, v in kwargs.items()
            }
        return self.replace(
            step=_advance(self.step, outcome, self.count_skipped_steps),
            params=new_params,
            opt_state=new_opt_state,
            **kwargs,
        )

    @classmethod
    def create(cls, *, apply_fn: Any, params: Any, tx: Any, **kwargs: Any) -> TrainState:
        """A new state with ``step`` an int32 zero and ``opt_state = tx.init(params)``.

        Args:
          apply_fn: usually ``model.apply``.
          params: the (float32 master) parameters.
          tx: ``lsj.loss_scaling(...)`` or ``lsj.loss_scaling_multi_steps(...)``
            (alone, or the only element of an ``optax.chain``).
          **kwargs: other fields: ``batch_stats``, ``count_skipped_steps``,
            ``rollback_on_skip``.

        Raises:
          ValueError: if ``tx``'s state holds no (or several) ``LossScaleState``,
            or one inside a refused nesting (see ``get_loss_scale_state``).
          TypeError: if ``count_skipped_steps`` or ``rollback_on_skip`` is not a bool.
        """
        for name in ("count_skipped_steps", "rollback_on_skip"):
            if name in kwargs:
                _check_bool(name, kwargs[name])
        opt_state = tx.init(params)
        _check_loss_scaled(opt_state, "TrainState.create")
        return cls(
            step=jnp.zeros([], jnp.int32),
            apply_fn=apply_fn,
            params=params,
            tx=tx,
            opt_state=opt_state,
            **kwargs,
        )


class LossScaleOptimizer(nnx.Optimizer[Any]):
    """A Flax NNX ``Optimizer`` for loss-scaled training.

    Rule (``update(model, grads, rollback=before)``)::

      params, opt_state = lsj.apply_gradients(tx, grads, opt_state, params)
      completed, applied, discard = what the update did (as ``TrainState``)
      step = step + 1 if (completed if count_skipped_steps else applied)
      if discard and before is not None:
          restore the rollback_filter variables (e.g. BatchStat) to ``before``

    With ``loss_scaling_multi_steps`` ``step`` counts applied windows and the
    rollback covers the window's first overflowing micro-batch to its end.

    NNX modules write their ``BatchStat`` variables during the forward pass,
    before ``update`` runs, so the rollback needs the values from before it:
    take ``before = opt.snapshot(model)`` before the forward pass and pass it
    as ``rollback=before``; without it nothing is rolled back.

    Args:
      model: the NNX module.
      tx: ``lsj.loss_scaling(...)`` or ``lsj.loss_scaling_multi_steps(...)``.
      wrt: the filter of the variables to train (as ``nnx.Optimizer``).
      count_skipped_steps: advance ``step`` on skipped steps too (default False).
      rollback_filter: the variables ``snapshot`` saves (default ``nnx.BatchStat``).

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> import lossscale_jax as lsj
      >>> model = nnx.Linear(3, 2, dtype=jnp.float16, param_dtype=jnp.float32,
      ...                    rngs=nnx.Rngs(0))
      >>> tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=2.0**10))
      >>> opt = lsj.LossScaleOptimizer(model, tx, wrt=nnx.Param)
      >>> bad = jax.tree_util.tree_map(lambda p: jnp.full_like(p, jnp.inf),
      ...                              nnx.state(model, nnx.Param))
      >>> _ = opt.update(model, bad)
      >>> int(opt.step[...])
      0
    """

    def __init__(
        self,
        model: Any,
        tx: optax.GradientTransformation,
        *,
        wrt: Any,
        count_skipped_steps: bool = False,
        rollback_filter: Any = nnx.BatchStat,
        **kwargs: Any,
    ):
        super().__init__(model, tx, wrt=wrt, **kwargs)
        self.count_skipped_steps: bool = _check_bool("count_skipped_steps", count_skipped_steps)
        self.rollback_filter = rollback_filter
        _check_loss_scaled(nnx.as_pure(self.opt_state), "LossScaleOptimizer")

    def snapshot(self, model: Any) -> Any:
        """The ``rollback_filter`` variables of ``model``, as pure arrays (a copy)."""
        return nnx.as_pure(nnx.state(model, self.rollback_filter, graph=self.graph))

    def update(
        self, model: Any, grads: Any, /, *, rollback: Any = None, **kwargs: Any
    ) -> optax.Params:
        """Applies the (scaled) gradients; on a skipped step ``step`` stays.

        Args:
          model: the module being trained.
          grads: gradients of ``lsj.scale_loss(loss, opt.opt_state)`` from ``nnx.grad``.
          rollback: ``opt.snapshot(model)`` taken before the forward pass, restored
            when the call's collections are discarded; ``None`` restores nothing.
          **kwargs: extra arguments for ``tx.update`` (``taps=``: the ``TapStats``
            of the backward pass, read by the overflow check).

        Returns:
          The new parameters (``wrt`` filtered), as pure arrays.
        """
        params = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
        grad_arrays = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
        opt_state = nnx.as_pure(self.opt_state)
        new_params, new_opt_state, outcome = _apply(
            self.tx, grad_arrays, opt_state, params, **nnx.as_pure(kwargs)
        )
        nnx.update(model, new_params)
        nnx.update(self.opt_state, nnx.state(new_opt_state, graph=self.graph))
        if rollback is not None:
            kept = keep_where("rollback", outcome.discard, rollback, self.snapshot(model))
            nnx.update(model, kept)
        self.step[...] = _advance(self.step[...], outcome, self.count_skipped_steps)
        return new_params
