"""Policies whose scale never moves: ``NoScale`` (bfloat16, float32) and ``StaticScale``."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.typing import ArrayLike

from lossscale_jax.engine import _hyper
from lossscale_jax.engine._policy import LossScalePolicy, as_overflow
from lossscale_jax.engine._state import LossScaleState, initial_state, record_step, with_scale


def _fixed_step(
    state: LossScaleState, overflow: ArrayLike, scale: float, skip_on_overflow: bool
) -> LossScaleState:
    flag = as_overflow(overflow)
    skipped = jnp.logical_and(flag, skip_on_overflow)
    own = jnp.asarray(scale, jnp.float32)
    return record_step(state, flag, skipped, stuck=flag, scale=own)


@dataclasses.dataclass(frozen=True)
class NoScale(LossScalePolicy):
    """No loss scaling (bfloat16 or float32 training): the scale stays 1.

    Rule::

      scale = 1                       # also for a state made by another policy
      skipped = overflow and skip_on_overflow

    Args:
      skip_on_overflow: skip the update when the gradients overflow. Off by
        default: ``NoScale`` is the identity unless asked.

    Examples:
      >>> import lossscale_jax as lsj
      >>> float(lsj.NoScale().init().scale)
      1.0
    """

    skip_on_overflow: bool = False

    def __post_init__(self) -> None:
        _hyper.store(
            self, skip_on_overflow=_hyper.check_bool("skip_on_overflow", self.skip_on_overflow)
        )

    @property
    def constant_scale(self) -> float:
        return 1.0

    def init(self) -> LossScaleState:
        return initial_state(1.0)

    def adjust(
        self, state: LossScaleState, overflow: ArrayLike, amax: ArrayLike | None = None
    ) -> LossScaleState:
        return _fixed_step(state, overflow, 1.0, self.skip_on_overflow)

    def conform(self, state: LossScaleState) -> LossScaleState:
        """``state`` at scale 1 (see ``LossScalePolicy.conform``)."""
        return with_scale(state, 1.0)


@dataclasses.dataclass(frozen=True)
class StaticScale(LossScalePolicy):
    """A fixed loss scale.

    Rule::

      scale = the policy's scale      # also for a state made by another policy
      skipped = overflow and skip_on_overflow

    The scale lives in the state (a float32 array), which ``scale_loss`` and
    the unscale read. A state made with another scale (restored from a
    checkpoint, or by another policy) still unscales its first step with the
    scale its gradients were computed with; ``adjust`` then writes the
    policy's own. ``lossscale_jax.switch_policy`` moves it before that step.

    Args:
      scale: the loss scale, a finite float > 0.
      skip_on_overflow: skip the update when the gradients overflow (default).

    Examples:
      >>> import lossscale_jax as lsj
      >>> float(lsj.StaticScale(128.0).init().scale)
      128.0
    """

    scale: float
    skip_on_overflow: bool = True

    def __post_init__(self) -> None:
        _hyper.store(
            self,
            scale=_hyper.check_positive_finite("scale", self.scale),
            skip_on_overflow=_hyper.check_bool("skip_on_overflow", self.skip_on_overflow),
        )

    @property
    def constant_scale(self) -> float:
        return self.scale

    def init(self) -> LossScaleState:
        return initial_state(self.scale)

    def adjust(
        self, state: LossScaleState, overflow: ArrayLike, amax: ArrayLike | None = None
    ) -> LossScaleState:
        return _fixed_step(state, overflow, self.scale, self.skip_on_overflow)

    def conform(self, state: LossScaleState) -> LossScaleState:
        """``state`` at the policy's scale (see ``LossScalePolicy.conform``)."""
        return with_scale(state, self.scale)
