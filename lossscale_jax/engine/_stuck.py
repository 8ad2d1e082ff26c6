"""What happens when overflows continue with the scale at its floor (``on_stuck``).

The engine's rule; its public path is ``lossscale_jax.stuck``.

``LossScaleState.stuck`` is set on a step that was skipped for a reason no loss scale
fixes: its gradients overflowed while the policy could not lower the scale any further, or
its update would have written inf or nan into a float16 parameter (``unlanded``: the inner
optimizer runs in float16; ``lsj.master_weights`` fixes that). With ``on_stuck="skip"``
(default) the step is skipped like any other and training goes on skipping;
``metrics(opt_state)["stuck"]`` (and ``["unlanded"]``) lets a host loop stop. With
``on_stuck="error"`` the update raises a ``checkify`` error, which the caller collects by
wrapping its step in ``jax.experimental.checkify.checkify``; an update that cannot land has
a message of its own, naming the float16 parameters and ``lsj.master_weights``.
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

UNLANDED_MESSAGE = (
    "loss scaling cannot land the update (step {{step}}): it would write inf or nan into the "
    "float16 parameters (of {leaves}; lsj.overflowed_leaves(opt_state, params) names those "
    "of the last step) although the gradients were finite, so the step was skipped, and no "
    "loss scale changes that: the inner optimizer runs in float16 (optax.adam's eps=1e-8 "
    "is 0 there, its second moment underflows). Keep float32 master copies of the "
    "parameters in the optimizer: lsj.loss_scaling(lsj.master_weights(inner), policy)."
)
_NAMED = 5  # leaves a message names before "and n more"


def named_leaves(leaves: tuple[str, ...] | list[str]) -> str:
    """``leaves`` for a message: the first few, then how many more."""
    more = len(leaves) - _NAMED
    return ", ".join(leaves[:_NAMED]) + (f" and {more} more" if more > 0 else "")


def validate_on_stuck(on_stuck: Any) -> str:
    """Returns ``on_stuck`` if it is ``"skip"`` or ``"error"``, else raises ``ValueError``."""
    if not isinstance(on_stuck, str) or on_stuck not in ON_STUCK:
        raise ValueError(f"on_stuck must be one of {ON_STUCK}, got {on_stuck!r}.")
    return on_stuck


def check_stuck(
    loss_scale: LossScaleState,
    on_stuck: str,
    when: Any = None,
    unlanded: Any = None,
    float16_leaves: tuple[str, ...] = (),
) -> None:
    """Adds a ``checkify`` check that ``loss_scale.stuck`` is False when ``on_stuck="error"``.

    ``when`` (a bool scalar; ``None``: always): the check fails only where it is true, for a
    state that is kept only on some steps (an accumulation window's end). ``unlanded`` (a
    bool scalar, or ``None``): the step is stuck because its update cannot land in the float16
    parameters ``float16_leaves``; it fails a check of its own, with its own message. The
    checks stay outside the step's skip, so they fire on exactly those steps whatever the
    skip's formulation (a select computes both branches on every step: ``_skip``).
    Traced once; with ``on_stuck="skip"`` it adds nothing to the step.
    """
    if on_stuck != "error":
        return
    stuck = loss_scale.stuck if when is None else jnp.logical_and(when, loss_scale.stuck)
    if unlanded is not None:
        cannot_land = unlanded if when is None else jnp.logical_and(when, unlanded)
        leaves = named_leaves(float16_leaves).replace("{", "{{").replace("}", "}}")
        checkify.check(
            jnp.logical_not(cannot_land),
            UNLANDED_MESSAGE.format(leaves=leaves or "the parameters"),
            step=loss_scale.total_steps,
        )
        stuck = jnp.logical_and(stuck, jnp.logical_not(cannot_land))
    checkify.check(
        jnp.logical_not(stuck),
        STUCK_MESSAGE,
        scale=loss_scale.scale,
        step=loss_scale.total_steps,
    )
