"""Putting an imported loss-scale state into an optimizer state."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from lossscale_jax.policies import LossScaleState
from lossscale_jax.transform import get_loss_scale_state


def _is_state(x: Any) -> bool:
    return isinstance(x, LossScaleState)


def _avals(state: LossScaleState) -> list[tuple[str, tuple[int, ...], str]]:
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return [
        (jax.tree_util.keystr(path), tuple(np.shape(x)), np.dtype(x.dtype).name)
        for path, x in leaves
    ]


def set_loss_scale_state(opt_state: Any, loss_scale_state: LossScaleState) -> Any:
    """``opt_state`` with its one ``LossScaleState`` replaced by ``loss_scale_state``.

    The way to resume a run brought over from another framework: build the
    optimizer with the imported policy, ``init`` it, then put the imported
    state in (the inner optimizer's state is restored as usual, or starts
    fresh).

    Rule::

      find the one LossScaleState in opt_state (as get_loss_scale_state does)
      check loss_scale_state has its fields, shapes and dtypes
      return opt_state with it replaced (the rest unchanged)

    Args:
      opt_state: an optimizer state holding exactly one ``LossScaleState``
        (``loss_scaling``'s state, possibly inside ``optax.chain``,
        ``MultiSteps``, ...), or a ``LossScaleState`` itself.
      loss_scale_state: the state to put in, e.g. from
        ``compat.torch.import_state(...)``.

    Returns:
      The optimizer state, same structure, with the new loss-scale state.

    Raises:
      ValueError: if ``opt_state`` holds no ``LossScaleState`` or several, or
        if ``loss_scale_state`` does not have the same fields, shapes and
        dtypes. TypeError: if ``loss_scale_state`` is not a ``LossScaleState``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> from lossscale_jax import compat
      >>> policy, state = compat.torch.import_state({
      ...     "scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
      ...     "growth_interval": 2000, "_growth_tracker": 7})
      >>> tx = lsj.loss_scaling(optax.sgd(0.1), policy)
      >>> opt_state = compat.set_loss_scale_state(tx.init({"w": jnp.zeros(2)}), state)
      >>> float(lsj.metrics(opt_state)["loss_scale"]), int(opt_state.loss_scale.growth_count)
      (1024.0, 7)
    """
    if not isinstance(loss_scale_state, LossScaleState):
        raise TypeError(
            f"loss_scale_state must be a LossScaleState, got {type(loss_scale_state).__name__}."
        )
    current = get_loss_scale_state(opt_state)
    if _avals(current) != _avals(loss_scale_state):
        raise ValueError(
            "loss_scale_state does not match the optimizer state's LossScaleState (fields, "
            f"shapes, dtypes): {_avals(loss_scale_state)} vs {_avals(current)}. Build it with "
            "the policy's init() (the compat import functions do)."
        )
    if isinstance(opt_state, LossScaleState):
        return loss_scale_state
    return jax.tree_util.tree_map(
        lambda x: loss_scale_state if _is_state(x) else x, opt_state, is_leaf=_is_state
    )
