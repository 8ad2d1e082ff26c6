"""``LossScaleState.policy_state`` in checkpoints: its structure, and Orbax checkpoints from
before it existed.

A policy's own state (``policy_state``) is ``None`` for most policies and a pytree of arrays
for the few that keep one, so two checkpoints of one optimizer differ there when the policy
does. ``check_policy_state`` names that mismatch. An Orbax checkpoint saved before the field
existed has no ``policy_state`` node, and Orbax refuses a target tree with one (even ``None``):
``restore_without_policy_state`` restores the fields it has and rebuilds the states.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from lossscale_jax.checkpoint._flax_serialization import FIELDS, POLICY_STATE
from lossscale_jax.engine._state import LossScaleState, is_loss_scale_state
from lossscale_jax.errors import CheckpointPolicyError

# {path: (shape, dtype name)}, as _checkpoint.py tabulates a tree's leaves.
Table = dict[tuple[str, ...], tuple[tuple[int, ...], str]]


def _described(table: Table) -> str:
    if not table:
        return "none"
    return ", ".join(f"{'/'.join(p)} {dtype}{list(shape)}" for p, (shape, dtype) in table.items())


def check_policy_state(where: str, prefix: tuple[str, ...], want: Table, have: Table) -> None:
    """Raises ``CheckpointPolicyError`` if the policy_state under ``prefix`` differs.

    ``want`` and ``have`` tabulate the target's and the checkpoint's leaves; ``where`` is
    ``prefix`` as the messages print it.
    """
    own = (*prefix, POLICY_STATE)
    n = len(own)
    mine = {p[n:]: v for p, v in want.items() if p[:n] == own}
    theirs = {p[n:]: v for p, v in have.items() if p[:n] == own}
    if mine != theirs:
        raise CheckpointPolicyError(
            f"The checkpoint's loss-scale state at {where!r} holds a policy_state of "
            f"{_described(theirs)}; the optimizer state's policy keeps {_described(mine)}: it "
            "was saved under another policy (or another setting of it, such as "
            "compat.fairseq's tolerance). Restore it into an optimizer built with the policy "
            "that saved it, then call lossscale_jax.switch_policy(restored, policy) to "
            "continue under this one."
        )


def saved_before_policy_state(nodes: list[Any]) -> bool:
    """Whether a loss-scale state of an Orbax metadata tree (``nodes``) has no policy_state."""
    return any(isinstance(node, dict) and POLICY_STATE not in node for node in nodes)


def _fields_of(x: Any) -> Any:
    if isinstance(x, LossScaleState):
        return {n: getattr(x, n) for n in FIELDS if n != POLICY_STATE}
    return x


def _state_of(target: Any, restored: Any) -> Any:
    if isinstance(target, LossScaleState):
        return LossScaleState(**restored, policy_state=None)
    return restored


def restore_without_policy_state(ckptr: Any, path: str | os.PathLike[str], target: Any) -> Any:
    """``ckptr.restore(path, target)`` for a checkpoint whose states have no policy_state.

    The caller has checked the leaves, so ``target``'s policy_state holds none (``None``).
    """
    fields = jax.tree_util.tree_map(_fields_of, target, is_leaf=is_loss_scale_state)
    restored = ckptr.restore(path, fields)
    return jax.tree_util.tree_map(_state_of, target, restored, is_leaf=is_loss_scale_state)
