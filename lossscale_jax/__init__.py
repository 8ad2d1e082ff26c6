"""lossscale_jax: loss scaling for mixed-precision training in JAX, as Optax transformations.

``import lossscale_jax`` loads JAX, Optax and chex only. The Flax integration
(``TrainState``, ``LossScaleOptimizer``) and the compatibility constructors
(``compat``) load on first use.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from lossscale_jax import errors, layerwise, taps, testing
from lossscale_jax.access._rollback import rollback_if_skipped
from lossscale_jax.accumulation import LossScalingMultiStepsState, loss_scaling_multi_steps
from lossscale_jax.checkpoint import (
    _flax_serialization,
    check_checkpoint,
    restore_flax,
    restore_orbax,
)
from lossscale_jax.diagnosis import Diagnosis, LeafDiagnosis, TapDiagnosis, diagnose
from lossscale_jax.engine._state import keep_policy_state
from lossscale_jax.fused import apply_gradients
from lossscale_jax.gradients import unscaled_global_norm, value_and_grad
from lossscale_jax.layerwise import layerwise_scaling
from lossscale_jax.master import MasterWeightsState, master_weights
from lossscale_jax.numerics import (
    check_overflow,
    check_overflow_and_range,
    unscale,
    unscale_and_check,
)
from lossscale_jax.policies import (
    DynamicScale,
    HeadroomScale,
    LossScalePolicy,
    LossScaleState,
    NoScale,
    StaticScale,
    TolerantDynamicScale,
)
from lossscale_jax.taps import TapStats, tap
from lossscale_jax.transform import (
    LossScalingState,
    get_loss_scale_state,
    loss_scaling,
    metrics,
    no_wiring_check,
    overflowed_leaves,
    reduce_overflow,
    scale_loss,
    set_loss_scale_state,
    switch_policy,
)

if _TYPE_CHECKING:
    from lossscale_jax import compat, presets
    from lossscale_jax.flax_utils import LossScaleOptimizer, TrainState

#: The version of this release, read by the build backend (pyproject.toml).
__version__ = "0.1.0"

# flax.serialization round-trips a LossScaleState once Flax loads, without this import
# loading it.
_flax_serialization.install()

# Names whose module loads on first use: (module, attribute or None for the module).
_LAZY = {
    "LossScaleOptimizer": ("lossscale_jax.flax_utils", "LossScaleOptimizer"),
    "TrainState": ("lossscale_jax.flax_utils", "TrainState"),
    "compat": ("lossscale_jax.compat", None),
    "presets": ("lossscale_jax.presets", None),
}


def __getattr__(name: str) -> _Any:
    if name in _LAZY:
        module_name, attribute = _LAZY[name]
        module = _importlib.import_module(module_name)
        value = module if attribute is None else getattr(module, attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lossscale_jax' has no attribute {name!r}")


# Imported submodules that hold internals only (the engine exports no public name).
_INTERNAL = {"engine"}


def __dir__() -> list[str]:
    # The public names (the lazy ones included) and the public modules, not the imports
    # this module made for itself.
    modules = {k for k, v in globals().items() if isinstance(v, type(_importlib))}
    return sorted(set(__all__) | {m for m in modules - _INTERNAL if not m.startswith("_")})


__all__ = [
    "Diagnosis",
    "DynamicScale",
    "HeadroomScale",
    "LeafDiagnosis",
    "LossScaleOptimizer",
    "LossScalePolicy",
    "LossScaleState",
    "LossScalingMultiStepsState",
    "LossScalingState",
    "MasterWeightsState",
    "NoScale",
    "StaticScale",
    "TapDiagnosis",
    "TapStats",
    "TolerantDynamicScale",
    "TrainState",
    "__version__",
    "apply_gradients",
    "check_checkpoint",
    "check_overflow",
    "check_overflow_and_range",
    "compat",
    "diagnose",
    "errors",
    "get_loss_scale_state",
    "keep_policy_state",
    "layerwise",
    "layerwise_scaling",
    "loss_scaling",
    "loss_scaling_multi_steps",
    "master_weights",
    "metrics",
    "no_wiring_check",
    "overflowed_leaves",
    "presets",
    "reduce_overflow",
    "restore_flax",
    "restore_orbax",
    "rollback_if_skipped",
    "scale_loss",
    "set_loss_scale_state",
    "switch_policy",
    "tap",
    "taps",
    "testing",
    "unscale",
    "unscale_and_check",
    "unscaled_global_norm",
    "value_and_grad",
]
