# pyright: reportMissingImports=false
# (Tunix is an optional dependency: the type check runs without it installed.)
"""Checkpoints of a Tunix trainer whose optimizer is loss-scaled.

Tunix's trainer restores its latest checkpoint in its constructor, against the optimizer it
built there, before ``enable`` can swap in the loss-scaled one: a loss-scaled optimizer state
saved under Tunix's item (``optimizer_state``) would make the next run's constructor fail
(its tree is not the plain optimizer's). So ``enable`` gives the trainer a checkpoint manager
that keeps Tunix's own ``save`` and ``maybe_restore`` and stores the optimizer item under
another name, :data:`ITEM`: the constructor of the next run restores the model and the step
(it sees no optimizer item), and ``enable`` then restores the optimizer into the loss-scaled
one (:func:`restore`). The renaming happens in an Orbax manager wrapped around Tunix's
(:class:`_Renamed`); a checkpoint Tunix saved itself keeps its ``optimizer_state``, which
this manager does not read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orbax.checkpoint as ocp
from tunix.sft import checkpoint_manager as tunix_checkpoints

ITEM = "lossscale_jax_optimizer_state"
TUNIX_ITEM = "optimizer_state"


def _renamed(composite: Any, old: str, new: str) -> Any:
    """An Orbax ``Composite`` with its item ``old`` named ``new`` (and ``new`` dropped)."""
    if composite is None:
        return None
    items = {k: v for k, v in composite.items() if k != new}
    if old in items:
        items[new] = items.pop(old)
    return ocp.args.Composite(**items)


class _Renamed:
    """An Orbax ``CheckpointManager`` that stores Tunix's optimizer item under :data:`ITEM`
    (every other call passes through)."""

    def __init__(self, manager: ocp.CheckpointManager) -> None:
        self._manager = manager

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def save(self, step: int, args: Any = None, **kwargs: Any) -> bool:
        return self._manager.save(step, args=_renamed(args, TUNIX_ITEM, ITEM), **kwargs)

    def restore(self, step: int | None, args: Any = None, **kwargs: Any) -> Any:
        out = self._manager.restore(step, args=_renamed(args, TUNIX_ITEM, ITEM), **kwargs)
        return _renamed(out, ITEM, TUNIX_ITEM)

    def metadata(self, step: int | None = None) -> Any:
        meta = self._manager.metadata(step)
        items = getattr(meta, "item_metadata", None)
        if items is None:
            return meta
        renamed = {k: v for k, v in items.items() if k != TUNIX_ITEM}
        if ITEM in renamed:
            renamed[TUNIX_ITEM] = renamed.pop(ITEM)
        return dataclasses.replace(meta, item_metadata=renamed)


class CheckpointManager(tunix_checkpoints.CheckpointManager):
    """Tunix's checkpoint manager, its optimizer item stored under :data:`ITEM`."""

    def __init__(self, root_directory: str | None = None, options: Any = None) -> None:
        super().__init__(None, None)
        if root_directory is not None:
            handlers = {
                "model_params": ocp.PyTreeCheckpointHandler(),
                ITEM: ocp.PyTreeCheckpointHandler(),
                "custom_metadata": ocp.JsonCheckpointHandler(),
            }
            manager = ocp.CheckpointManager(
                root_directory,
                item_handlers=handlers,
                options=options or tunix_checkpoints._DEFAULT_CHECKPOINTING_OPTIONS,
            )
            self._checkpoint_manager = _Renamed(manager)


def install(trainer: Any) -> None:
    """Gives ``trainer`` the manager above, in place of the one its constructor made."""
    root = trainer.config.checkpoint_root_directory
    if root is None:
        return
    trainer.checkpoint_manager.close()
    trainer.checkpoint_manager = CheckpointManager(root, trainer.config.checkpointing_options)


def restore(trainer: Any, every_k: int) -> None:
    """Restores the latest checkpoint into the loss-scaled optimizer (and the model), and the
    trainer's step counters from it, as the trainer's constructor does."""
    step, custom = trainer.checkpoint_manager.maybe_restore(
        trainer.model, trainer.optimizer, restore_only_lora_params=trainer._lora_enabled
    )
    if step:
        trainer._train_steps = step
        trainer._iter_steps = step * every_k
        trainer._restored_custom_metadata = custom
