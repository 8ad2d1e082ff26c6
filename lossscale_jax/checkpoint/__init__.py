"""Saving and restoring optimizer states that hold a ``LossScaleState``.

Orbax handles ``LossScaleState`` as it is (a registered pytree).
``flax.serialization`` knows it as a state dict of its fields, so
``flax.serialization.to_bytes``/``from_bytes`` round-trip it (registered when
Flax's serialization module loads; ``import lossscale_jax`` loads no Flax).
``restore_orbax`` and ``restore_flax`` check the checkpoint's structure
against the optimizer state before restoring, so a checkpoint saved
without loss scaling fails with an error that says so. Given ``policy=``,
they also refuse a loss-scale state that the policy would not hold (saved
under another policy): ``switch_policy`` is the way to continue with it.

Holds: ``_checkpoint`` (the three functions; the one module that imports Flax's
serialization and Orbax, on first use), ``_policy_state`` (a policy's own state in
checkpoints, and Orbax checkpoints from before it) and ``_flax_serialization``
(``LossScaleState`` registered with ``flax.serialization`` when that module loads, installed
by ``import lossscale_jax`` without loading Flax). Checkpoints record field names, never
module paths: the layout of this package is not in them.

May import: what lies below it in the package's order (``engine``, ``policies``, ``taps``,
``access``, the front-end modules, ``layerwise``, ``diagnosis``) and ``errors``.
"""

from lossscale_jax.checkpoint._checkpoint import check_checkpoint, restore_flax, restore_orbax

__all__ = ["check_checkpoint", "restore_flax", "restore_orbax"]
