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

On Tunix's main branch the manager keeps an Orbax v1 ``training.Checkpointer`` (its
``_checkpointer``) and saves ``{"model_params", "optimizer_state"}`` as checkpointables; the
same renaming happens in a checkpointer wrapped around it (:class:`_RenamedV1`), its
metadata included (Tunix's ``maybe_restore`` restores the optimizer where the metadata names
its item).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orbax.checkpoint as ocp
from tunix.sft import checkpoint_manager as tunix_checkpoints

ITEM = "lossscale_jax_optimizer_state"
TUNIX_ITEM = "optimizer_state"


def _renamed_items(items: Any, old: str, new: str) -> dict[str, Any]:
    """``items`` (a mapping) with its item ``old`` named ``new`` (and ``new`` dropped)."""
    out = {k: v for k, v in items.items() if k != new}
    if old in out:
        out[new] = out.pop(old)
    return out


def _renamed(composite: Any, old: str, new: str) -> Any:
    """An Orbax ``Composite`` with its item ``old`` named ``new`` (and ``new`` dropped)."""
    if composite is None:
        return None
    return ocp.args.Composite(**_renamed_items(composite, old, new))


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
        renamed = _renamed_items(items, ITEM, TUNIX_ITEM)
        return dataclasses.replace(meta, item_metadata=renamed)


class _RenamedV1:
    """An Orbax v1 ``training.Checkpointer`` (Tunix's main branch) that stores Tunix's
    optimizer item under :data:`ITEM` (every other call passes through)."""

    def __init__(self, checkpointer: Any) -> None:
        self._checkpointer = checkpointer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._checkpointer, name)

    def save_checkpointables(self, step: int, checkpointables: Any, **kwargs: Any) -> Any:
        renamed = _renamed_items(checkpointables, TUNIX_ITEM, ITEM)
        return self._checkpointer.save_checkpointables(step, renamed, **kwargs)

    def save_checkpointables_async(self, step: int, checkpointables: Any, **kwargs: Any) -> Any:
        renamed = _renamed_items(checkpointables, TUNIX_ITEM, ITEM)
        return self._checkpointer.save_checkpointables_async(step, renamed, **kwargs)

    def load_checkpointables(self, step: Any = None, abstract: Any = None) -> Any:
        asked = None if abstract is None else _renamed_items(abstract, TUNIX_ITEM, ITEM)
        out = self._checkpointer.load_checkpointables(step, asked)
        return _renamed_items(out, ITEM, TUNIX_ITEM)

    def checkpointables_metadata(self, step: Any = None) -> Any:
        meta = self._checkpointer.checkpointables_metadata(step)
        return None if meta is None else _MetadataV1(meta)


class _MetadataV1:
    """A checkpoint's v1 metadata whose ``metadata`` names :data:`ITEM` as Tunix's item."""

    def __init__(self, meta: Any) -> None:
        self._meta = meta
        items = meta.metadata
        self.metadata = _renamed_items(items, ITEM, TUNIX_ITEM) if items is not None else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._meta, name)


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


def install(trainer: Any, v1: bool = False) -> None:
    """Gives ``trainer`` the manager above, in place of the one its constructor made;
    ``v1``: Tunix's main branch (its manager's Orbax v1 checkpointer, renamed)."""
    root = trainer.config.checkpoint_root_directory
    if root is None:
        return
    trainer.checkpoint_manager.close()
    options = trainer.config.checkpointing_options
    if not v1:
        trainer.checkpoint_manager = CheckpointManager(root, options)
        return
    manager = tunix_checkpoints.CheckpointManager(root_directory=root, options=options)
    manager._checkpointer = _RenamedV1(manager._checkpointer)
    trainer.checkpoint_manager = manager


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
