"""Loss-scale policies and the state they adjust.

``LossScaleState`` is a pytree of fixed-dtype arrays and nothing else (its ``policy_state``
is ``None`` or more such arrays). A policy holds
static, validated hyperparameters and three pure functions: ``init() -> LossScaleState``,
``adjust(state, overflow, amax=None) -> LossScaleState`` and ``conform(state)``
(see ``LossScalePolicy``). One module per kind of policy:

- ``_fixed``: ``NoScale`` and ``StaticScale``, whose scale never moves;
- ``_dynamic``: ``DynamicScale`` (growth, backoff, hysteresis, bounds);
- ``_tolerant``: ``TolerantDynamicScale`` (backs off past a tolerated overflow rate);
- ``_headroom``: ``HeadroomScale`` (the scale set from the gradients' own range).

The protocol itself (``LossScalePolicy``) and the state are the engine's (``engine/_policy``,
``engine/_state``): the engine calls a policy without importing this folder.

May import: ``lossscale_jax.engine`` and ``lossscale_jax.errors``, nothing above them.
"""

from lossscale_jax.engine._policy import LossScalePolicy
from lossscale_jax.engine._state import RECENT_STEPS, LossScaleState, initial_state
from lossscale_jax.policies._dynamic import DynamicScale
from lossscale_jax.policies._fixed import NoScale, StaticScale
from lossscale_jax.policies._headroom import HeadroomScale
from lossscale_jax.policies._tolerant import TolerantDynamicScale

__all__ = [
    "RECENT_STEPS",
    "DynamicScale",
    "HeadroomScale",
    "LossScalePolicy",
    "LossScaleState",
    "NoScale",
    "StaticScale",
    "TolerantDynamicScale",
    "initial_state",
]
