"""What a step wrote into model state, kept or rolled back by what its update did.

A forward pass writes model state (BatchNorm's running statistics: Flax's ``batch_stats``,
an Equinox ``eqx.nn.State``) before the update decides; on a skipped step that pass saw the
overflowing batch and its statistics may hold inf. ``outcome`` reads from the new optimizer
state what the update did (``engine/_opt_states.step_outcome``), ``keep_where`` picks, leaf
by leaf, and ``rollback_if_skipped`` is the two for any framework; the Flax train states
call them too.
"""

from __future__ import annotations

from typing import Any

import jax

from lossscale_jax.engine._nesting import locate
from lossscale_jax.engine._ops import where
from lossscale_jax.engine._opt_states import StepOutcome, step_outcome
from lossscale_jax.errors import StateNotFoundError


def outcome(opt_state: Any) -> StepOutcome:
    """What the update that produced ``opt_state`` did (see ``step_outcome``)."""
    _, owner = locate(opt_state)
    found = step_outcome(owner)
    if found is None:
        raise StateNotFoundError(
            "the optimizer state holds a bare LossScaleState, not the state of "
            "lossscale_jax.loss_scaling or loss_scaling_multi_steps: build tx with one of them."
        )
    return found


def keep_where(name: str, discard: jax.Array, old: Any, new: Any) -> Any:
    """``old`` where ``discard``, else ``new``, leaf by leaf; two structures raise, naming
    ``name``."""
    old_def = jax.tree_util.tree_structure(old)
    new_def = jax.tree_util.tree_structure(new)
    if old_def != new_def:
        raise ValueError(
            f"{name}: cannot roll back on a skipped step, the new value's structure "
            f"{new_def} differs from the stored one {old_def}. Create the state with an "
            f"initial {name} (or pass rollback_on_skip=False)."
        )
    return jax.tree_util.tree_map(lambda o, n: where(discard, o, n), old, new)


def rollback_if_skipped(opt_state: Any, before: Any, after: Any) -> Any:
    """``before`` if the step that produced ``opt_state`` must not keep what its forward
    pass wrote, else ``after``: the model state (BatchNorm statistics) of a skipped step.

    Rule (leaf by leaf, a select: no host sync)::

      discard = the update that produced opt_state was skipped
                (accumulation: from the window's first overflowing micro-batch to its end)
      return where(discard, before, after)

    What ``lsj.TrainState`` does for ``batch_stats`` and ``lsj.LossScaleOptimizer`` for
    ``rollback=``, for any framework: an Equinox ``eqx.nn.State``, a Haiku state, a dict.

    Args:
      opt_state: the optimizer state the update returned.
      before: the model state before the step's forward pass.
      after: the model state the forward pass returned (the structure of ``before``).

    Returns:
      ``before`` or ``after``, leaf by leaf.

    Raises:
      ValueError: if ``before`` and ``after`` differ in structure, or ``opt_state`` holds no
        loss-scaling state (as ``get_loss_scale_state``).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale())
      >>> params = {"w": jnp.ones(2)}
      >>> _, opt_state = tx.update({"w": jnp.full(2, jnp.inf)}, tx.init(params), params)
      >>> stats, new_stats = {"mean": jnp.zeros(2)}, {"mean": jnp.full(2, jnp.inf)}
      >>> lsj.rollback_if_skipped(opt_state, stats, new_stats)["mean"].tolist()
      [0.0, 0.0]
    """
    return keep_where("rollback_if_skipped", outcome(opt_state).discard, before, after)
