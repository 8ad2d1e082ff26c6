"""``flax.serialization`` learns ``LossScaleState`` without ``import lossscale_jax`` loading Flax.

``register()`` registers ``LossScaleState`` as a state dict of its fields, so that
``flax.serialization.to_bytes``/``from_bytes`` round-trip an optimizer state holding it.
``install()`` (called by ``import lossscale_jax``) runs ``register()`` now if
``flax.serialization`` is already imported, and otherwise the moment it is: a finder on
``sys.meta_path`` wraps that one module's loader and registers after it has run. Nothing
of Flax is imported by this module itself.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from lossscale_jax.engine._state import LossScaleState

FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(LossScaleState))
POLICY_STATE = "policy_state"
"""The one field that is a pytree (or ``None``) rather than an array."""
_MODULE = "flax.serialization"


def register(serialization: ModuleType) -> None:
    """Registers ``LossScaleState`` with ``serialization`` (the ``flax.serialization`` module)."""

    def to_state_dict(state: LossScaleState) -> dict[str, Any]:
        return {name: serialization.to_state_dict(getattr(state, name)) for name in FIELDS}

    def from_state_dict(target: LossScaleState, state: dict[str, Any]) -> LossScaleState:
        # A checkpoint from before ``policy_state`` existed lacks it: it restores into a
        # target whose policy keeps none.
        missing = [n for n in FIELDS if n not in state and not _optional(n, target)]
        unknown = sorted(set(state) - set(FIELDS))
        if missing or unknown:
            raise ValueError(
                f"the checkpoint's LossScaleState does not match this version's fields: "
                f"missing {missing}, unknown {unknown} (at {serialization.current_path()!r})."
            )
        saved_own = state.get(POLICY_STATE)
        if (saved_own is None) != (target.policy_state is None):
            raise ValueError(
                "the checkpoint's LossScaleState was saved under a policy that keeps "
                f"{'no' if saved_own is None else 'its own'} policy_state, and the target's "
                f"policy keeps {'none' if target.policy_state is None else 'one'} (at "
                f"{serialization.current_path()!r}): restore into a target built with the "
                "policy that saved it, then lossscale_jax.switch_policy to change policy."
            )
        return target.replace(
            **{
                n: serialization.from_state_dict(getattr(target, n), state[n], name=n)
                for n in FIELDS
                if n in state
            }
        )

    serialization.register_serialization_state(
        LossScaleState, to_state_dict, from_state_dict, override=True
    )


def _optional(name: str, target: LossScaleState) -> bool:
    return name == POLICY_STATE and target.policy_state is None


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the real loader of ``flax.serialization``, then ``register``."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        register(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; for ``flax.serialization`` it wraps the spec the others find."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Registers now if ``flax.serialization`` is loaded, else when it first is."""
    module = sys.modules.get(_MODULE)
    if module is not None:
        register(module)
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
