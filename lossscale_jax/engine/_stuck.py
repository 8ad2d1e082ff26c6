"""What happens when overflows continue with the scale at its floor (``on_stuck``).

The engine's rule; its public path is ``lossscale_jax.stuck``.

``LossScaleState.stuck`` is set on a step that overflowed while the policy
could not lower the scale any further. With ``on_stuck="skip"`` (default)
the step is skipped like any other overflow and training goes on skipping;
``metrics(opt_state)["stuck"]`` lets a host loop stop. With
``on_stuck="error"`` the update raises a ``checkify`` error, which the
caller collects by wrapping its step in ``jax.experimental.checkify.checkify``.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax.experimental import checkify

from lossscale_jax.engine._state import LossScaleState

ON_STUCK: tuple[str, ...] = ("skip", "error")

STUCK_MESSAGE = (
    "loss scaling is stuck: the gradients overflowed with the loss scale already at its floor "
    "(scale={scale}, step {step}); the update was skipped. Lower min_scale, fix the model's "
    "non-finite gradients, or use on_stuck='skip'."
)


def validate_on_stuck(on_stuck: Any) -> str:
    """Returns ``on_stuck`` if it is ``"skip"`` or ``"error"``, else raises ``ValueError``."""
    if not isinstance(on_stuck, str) or on_stuck not in ON_STUCK:
        raise ValueError(f"on_stuck must be one of {ON_STUCK}, got {on_stuck!r}.")
    return on_stuck


def check_stuck(loss_scale: LossScaleState, on_stuck: str, when: Any = None) -> None:
    """Adds a ``checkify`` check that ``loss_scale.stuck`` is False when ``on_stuck="error"``.

    ``when`` (a bool scalar; ``None``: always): the check fails only where it is true, for a
    state that is kept only on some steps (an accumulation window's end). The check stays
    outside the step's skip, so it fires on exactly those steps whatever the skip's
    formulation (a select computes both branches on every step: ``_skip``).
    Traced once; with ``on_stuck="skip"`` it adds nothing to the step.
    """
    if on_stuck == "error":
        stuck = loss_scale.stuck if when is None else jnp.logical_and(when, loss_scale.stuck)
        checkify.check(
            jnp.logical_not(stuck),
            STUCK_MESSAGE,
            scale=loss_scale.scale,
            step=loss_scale.total_steps,
        )
