"""The interface every loss-scale policy implements, and the check of a ``policy`` argument."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from lossscale_jax.engine._state import LossScaleState
from lossscale_jax.errors import NotAPolicyError


class LossScalePolicy(abc.ABC):
    """Base class of loss-scale policies.

    A policy is immutable and hashable; its hyperparameters are static Python
    values, checked when it is built. Every policy implements the same three
    methods:

    - ``init() -> LossScaleState``: a fresh state at the starting scale;
    - ``adjust(state, overflow, amax=None) -> LossScaleState``: the state after
      one step whose overflow flag (already reduced across devices) is
      ``overflow``; ``amax`` is the step's measured range, given when the
      policy declares ``measures_range`` and ignored otherwise;
    - ``conform(state) -> LossScaleState``: ``state`` moved to where this
      policy keeps it, without taking a step (``switch_policy``, checkpoint
      checks).

    ``init`` and ``adjust`` are abstract: a subclass without them is refused
    when it is built.

    ``adjust`` obeys the policy whatever state it is given (a state restored
    from a checkpoint, or made by another policy): its result is always a
    state this policy can hold. It is pure and jit-able, with no Python branch
    on array values.

    Examples:
      >>> import lossscale_jax as lsj
      >>> policy = lsj.DynamicScale(init_scale=8.0, growth_interval=2)
      >>> isinstance(policy, lsj.LossScalePolicy)
      True
      >>> state = policy.init()
      >>> state = policy.adjust(state, True)            # an overflow: back off, skip
      >>> float(state.scale), bool(state.last_skipped)
      (4.0, True)
      >>> state = policy.adjust(policy.adjust(state, False), False)  # two good steps: grow
      >>> float(state.scale), int(state.total_steps)
      (8.0, 3)
      >>> capped = lsj.DynamicScale(init_scale=4.0, max_scale=4.0)
      >>> float(capped.conform(state).scale)            # into the other policy's bounds
      4.0
    """

    #: Whether ``adjust`` reads ``amax``, the gradients' range. The overflow check
    #: measures it (in the same pass, the same collective) only for such a policy.
    measures_range: ClassVar[bool] = False

    @property
    def constant_scale(self) -> float | None:
        """The scale, if this policy never moves it (``NoScale``: 1.0, ``StaticScale(s)``:
        ``s``); ``None`` for a policy that adjusts it. The wiring check reads it: it does not
        ask a scale of 1 to be applied, nor a constant one to be read from the step's state.
        """
        return None

    @abc.abstractmethod
    def init(self) -> LossScaleState:
        """A fresh state at the policy's starting scale, every counter at zero."""

    @abc.abstractmethod
    def adjust(
        self, state: LossScaleState, overflow: ArrayLike, amax: ArrayLike | None = None
    ) -> LossScaleState:
        """The state after one step whose (reduced) overflow flag is ``overflow``.

        ``amax`` is the step's range (see ``HeadroomScale``); policies that do
        not declare ``measures_range`` ignore it.
        """

    def conform(self, state: LossScaleState) -> LossScaleState:
        """``state`` moved to where this policy keeps it, without taking a step.

        Rule::

          scale = the nearest scale this policy can hold (see each policy)
          if scale moved: growth_count = hysteresis_count = 0
          every other field (telemetry, flags) is kept

        ``lossscale_jax.switch_policy`` applies it to an optimizer state. A
        state the policy produced itself comes back unchanged. Every policy of
        the library implements it; a subclass that does not cannot be switched
        to, nor checked against a checkpoint.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not implement conform(state); a LossScalePolicy "
            "subclass needs it for switch_policy and the checkpoint checks."
        )


POLICY_NAMES = "NoScale, StaticScale, DynamicScale, TolerantDynamicScale, HeadroomScale"


def check_policy(policy: Any, name: str = "policy") -> LossScalePolicy:
    """``policy`` if it is a policy instance, else ``NotAPolicyError`` saying what to write."""
    if isinstance(policy, LossScalePolicy):
        return policy
    if isinstance(policy, type) and issubclass(policy, LossScalePolicy):
        raise NotAPolicyError(
            f"{name} must be a policy instance, got the class {policy.__name__}: "
            f"write {policy.__name__}(...), e.g. lossscale_jax.DynamicScale() or "
            "lossscale_jax.StaticScale(128.0)."
        )
    raise NotAPolicyError(
        f"{name} must be a lossscale_jax policy ({POLICY_NAMES}, or one built by "
        f"lossscale_jax.compat), got {policy!r}."
    )


def as_overflow(overflow: ArrayLike) -> jax.Array:
    """The overflow flag as a scalar bool array; anything else is a ``ValueError``."""
    flag = jnp.asarray(overflow)
    if flag.shape != ():
        raise ValueError(f"overflow must be a scalar, got shape {flag.shape}.")
    return flag.astype(jnp.bool_)
