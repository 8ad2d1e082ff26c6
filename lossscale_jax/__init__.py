"""lossscale_jax: loss scaling for mixed-precision training in JAX, as Optax transformations."""

from lossscale_jax import compat, testing
from lossscale_jax.accumulation import LossScalingMultiStepsState, loss_scaling_multi_steps
from lossscale_jax.checkpoint import check_checkpoint, restore_flax, restore_orbax
from lossscale_jax.diagnosis import Diagnosis, LeafDiagnosis, diagnose
from lossscale_jax.flax_utils import LossScaleOptimizer, TrainState
from lossscale_jax.fused import apply_gradients
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
from lossscale_jax.transform import (
    LossScalingState,
    get_loss_scale_state,
    loss_scaling,
    metrics,
    overflowed_leaves,
    reduce_overflow,
    scale_loss,
    set_loss_scale_state,
    switch_policy,
)

#: The version of this release, read by the build backend (pyproject.toml).
__version__ = "0.1.0"

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
    "NoScale",
    "StaticScale",
    "TolerantDynamicScale",
    "TrainState",
    "__version__",
    "apply_gradients",
    "check_checkpoint",
    "compat",
    "check_overflow",
    "check_overflow_and_range",
    "diagnose",
    "get_loss_scale_state",
    "loss_scaling",
    "loss_scaling_multi_steps",
    "metrics",
    "overflowed_leaves",
    "reduce_overflow",
    "restore_flax",
    "restore_orbax",
    "scale_loss",
    "set_loss_scale_state",
    "switch_policy",
    "testing",
    "unscale",
    "unscale_and_check",
]
