"""What happens when overflows continue with the scale at its floor (``on_stuck``).

``LossScaleState.stuck`` is set on a step that was skipped for a reason no loss
scale fixes: it overflowed while the policy could not lower the scale any
further, or its update would have written inf or nan into a float16 parameter
(``metrics(opt_state)["unlanded"]``: an inner optimizer that runs in float16;
``lsj.master_weights`` fixes it). With ``on_stuck="skip"`` (default) the step
is skipped like any other and training goes on skipping;
``metrics(opt_state)["stuck"]`` lets a host loop stop. With
``on_stuck="error"`` the update raises a ``checkify`` error
(``STUCK_MESSAGE``, or ``UNLANDED_MESSAGE`` naming the float16 parameters and
``lsj.master_weights``), which the caller collects by wrapping its step in
``jax.experimental.checkify.checkify``.

The rule is the engine's (``engine/_stuck.py``); this module keeps its public path.
"""

from __future__ import annotations

from lossscale_jax.engine._stuck import (
    ON_STUCK,
    STUCK_MESSAGE,
    UNLANDED_MESSAGE,
    check_stuck,
    validate_on_stuck,
)

__all__ = ["ON_STUCK", "STUCK_MESSAGE", "UNLANDED_MESSAGE", "check_stuck", "validate_on_stuck"]
