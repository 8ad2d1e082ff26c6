"""Taps: statistics of the activation gradients, from inside the backward pass.

Everything else the library measures is a parameter gradient. float16 fails earlier than
that: in the loss's own cotangent, in the backward signal between layers. A tap marks a value
of the forward pass; in the backward pass it records, for the cotangent arriving there, the
largest magnitude, how much of it is zero or subnormal in float16, and its inf/nan entries,
under ``jit``, ``pmap``/``shard_map``, ``scan`` and ``remat``, with no host sync.

- Plain JAX: ``lsj.tap(x, "name")`` where a boundary is.
- Flax Linen: every module's ``__call__`` output is tapped, named by its module path, without
  changing the model (method interception while the loss is traced).
- Flax NNX: the same, for the modules of ``recording(..., model=model)``.
- ``lsj.scale_loss`` taps the loss itself (``"loss"``), so a float16 loss needs no user code.

The statistics come back as the "gradient" of zero-valued inputs, one per tap (the sinks,
a ``TapStats``): ``value_and_grad`` below does it in one call. Hand them to the optimizer
(``tx.update(grads, opt_state, params, taps=stats)``, ``apply_gradients(..., taps=)``,
``TrainState.apply_gradients(grads=, taps=)``): an inf or nan in a tapped cotangent counts as
an overflow, and ``HeadroomScale`` keeps its scale below the range the taps show (reduced
over devices in the overflow flag's own collective). ``lsj.diagnose`` reads them to name the
layer where float16 breaks.

Outside ``recording`` (and ``value_and_grad``) a tap is the identity: a step that does not ask
for taps has no trace of them in its program.

Holds: ``_taps`` (the public functions), ``_tapping`` (the tap's ``custom_vjp``, the
recorder, the Linen/NNX interception) and ``_upcast`` (a float16 function evaluated in float32
with its taps kept, for ``diagnose``). The statistics vector itself, ``TapStats``, is the
engine's (``engine/_tap_stats``): the engine reads it without importing this folder.

May import: what lies below it in the package's order (``engine``, ``policies``) and ``errors``.
"""

# TapStats is documented where lossscale_jax exports it (lsj.TapStats) and Modules where it is
# used (layerwise, diagnose); both stay importable here.
from lossscale_jax.engine._tap_stats import TapStats as TapStats
from lossscale_jax.taps._taps import Modules as Modules
from lossscale_jax.taps._taps import discover, recording, tap, value_and_grad

__all__ = ["discover", "recording", "tap", "value_and_grad"]
