"""The exceptions lossscale_jax raises for a mistake a user can fix.

Each is a subclass of the built-in exception it was before (``ValueError`` or
``TypeError``), so ``except ValueError`` keeps working; catch the class to react to one
kind of mistake without reading the message. Every message names the argument or the
nesting at fault and what to write instead (docs/errors.md lists them).

Examples:
  >>> import jax.numpy as jnp, optax
  >>> import lossscale_jax as lsj
  >>> tx = optax.MultiSteps(lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale()), 2)
  >>> try:
  ...     lsj.get_loss_scale_state(tx.init({"w": jnp.zeros(2)}))
  ... except lsj.errors.NestingError as e:
  ...     print(type(e).__name__, isinstance(e, ValueError))
  NestingError True
"""

from __future__ import annotations

__all__ = [
    "AxisError",
    "CheckpointError",
    "CheckpointPolicyError",
    "CheckpointVersionError",
    "Float16OptimizerWarning",
    "GradientDtypeError",
    "IntegrationError",
    "IntegrationWarning",
    "LossScalingError",
    "NestingError",
    "NotAPolicyError",
    "StateNotFoundError",
    "StructureError",
    "TapError",
    "WiringError",
    "WiringWarning",
]


class LossScalingError(Exception):
    """Base class of this module's exceptions."""


class NotAPolicyError(LossScalingError, TypeError):
    """A ``policy`` argument that is not a ``LossScalePolicy`` instance (a class, a number)."""


class StateNotFoundError(LossScalingError, ValueError):
    """An optimizer state without the loss-scale state a function needs (or with several)."""


class NestingError(LossScalingError, ValueError):
    """A nesting that would let scaled gradients or skipped steps reach training.

    Raised for ``loss_scaling`` inside another loss scaling, ``optax.MultiSteps`` or another
    Optax wrapper outside it, or ``optax.chain`` with transformations beside it.
    """


class AxisError(LossScalingError, ValueError):
    """An ``axis_name``/``local_axes`` that is unbound where the step runs, or a mapped axis
    (``jax.pmap``/``jax.shard_map``) over which devices would take different decisions."""


class StructureError(LossScalingError, ValueError):
    """Gradients or parameters whose structure differs from the one ``tx.init`` saw."""


class CheckpointError(LossScalingError, ValueError):
    """A checkpoint that does not have the optimizer state's structure."""


class CheckpointVersionError(CheckpointError):
    """A checkpoint saved by an earlier version, without fields this version keeps."""


class CheckpointPolicyError(CheckpointError):
    """A checkpoint's loss-scale state that the policy given to restore would not hold."""


class TapError(LossScalingError, ValueError):
    """Taps used wrongly: sinks that do not match the taps a function meets, taps handed to a
    transformation that cannot read them, or a tap name that is not a non-empty string."""


class WiringError(LossScalingError, ValueError):
    """A step wired so that it would train silently wrong, seen while it is traced: the
    gradients of a loss that was never scaled, a loss scaled twice, a loss scale frozen into
    the trace (docs/errors.md says what the check sees and what it cannot)."""


class IntegrationError(LossScalingError, RuntimeError):
    """An integration (``lossscale_jax.integrations``) given a framework release that lacks a
    name it relies on, an object of the framework it does not know or cannot keep, or a
    framework not installed. Raised before anything was changed."""


class IntegrationWarning(UserWarning):
    """An integration given a framework release it was not tested with (every name it relies
    on is there), or a setting that works but is not needed (a loss scale for bfloat16)."""


class GradientDtypeError(WiringError, TypeError):
    """An integer or bool gradient leaf given to a loss-scaling update: it could be neither
    unscaled nor checked, and would reach the inner optimizer scaled."""


class WiringWarning(UserWarning):
    """A wiring that is right only under a condition the trace cannot show (e.g. the loss
    scaled with another optimizer state of the same step than the one ``update`` reads)."""


class Float16OptimizerWarning(UserWarning):
    """float16 parameters given to an inner optimizer that would run in float16 (its moments,
    its ``eps`` and its update in float16): wrap it in ``lossscale_jax.master_weights``."""
