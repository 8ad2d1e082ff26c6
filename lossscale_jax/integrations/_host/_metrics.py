"""The loss scale's metrics, named for a host's logger, and what a skipped step was, said.

A host logs a dict of scalars per step (EasyDeL's ``LossMetrics.other_metrics``, Tunix's
metrics buffer); :func:`scale_metrics` gives the loss scale's, computed on the device after
the step's update (no host sync): ``loss_scale/scale_used`` (the scale the step's loss was
multiplied by), ``loss_scale/loss_scale`` (the scale after the step's adjustment: the next
step's), ``loss_scale/skipped``, ``loss_scale/skipped_steps`` and
``loss_scale/overflow_rate``.

:func:`why` is what a step says of itself for the log (one float32 vector, :data:`WHY` names
its entries), computed on the device beside those; :class:`Teller` reads the vectors a host
has already brought to the host and writes a log line the first time a step was skipped
(what was not finite: the loss, or the gradients and which leaf; what the policy did with its
scale) and one when the run is stuck (:data:`STUCK_AFTER` steps in a row skipped that no loss
scale fixes).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale_jax.access._access import get_loss_scale_state
from lossscale_jax.access._metrics import metrics

PREFIX = "loss_scale/"
KEYS = ("scale_used", "loss_scale", "skipped", "skipped_steps", "overflow_rate")
#: The entries of :func:`why`'s vector.
WHY: tuple[str, ...] = (
    "skipped",
    "loss_finite",
    "scale_used",
    "loss_scale",
    "stuck",
    "overflow_leaves",
    "first_overflow_leaf",
    "unlanded",
)
#: Optimizer steps skipped in a row, each one that no loss scale fixes (a non-finite loss, or
#: the policy's scale unable to go lower: ``lsj.metrics``' ``stuck``), before the log says
#: the run is stuck.
STUCK_AFTER = 3


def scale_used(opt_state: Any) -> jax.Array:
    """The scale a step multiplies its loss by, read from ``opt_state`` before its update."""
    return jnp.asarray(get_loss_scale_state(opt_state).scale, jnp.float32)


def scale_metrics(opt_state: Any, used: Any, prefix: str = PREFIX) -> dict[str, jax.Array]:
    """The loss scale's metrics of ``opt_state`` (after the update), keyed ``prefix + key``;
    ``used``: the scale the step's loss was multiplied by (:func:`scale_used`)."""
    now = {**metrics(opt_state), "scale_used": jnp.asarray(used, jnp.float32)}
    return {prefix + k: now[k] for k in KEYS}


def why(loss: Any, opt_state: Any, used: Any) -> jax.Array:
    """What the step says of itself for the log line, as :data:`WHY` names it: ``loss`` (the
    step's, unscaled), ``opt_state`` after the update, ``used`` the scale the loss was
    multiplied by."""
    said = {**metrics(opt_state), "scale_used": used}
    said["loss_finite"] = jnp.all(jnp.isfinite(jnp.asarray(loss)))
    said.setdefault("overflow_leaves", 0)
    said.setdefault("first_overflow_leaf", -1)
    return jnp.stack([jnp.asarray(said[k], jnp.float32) for k in WHY])


class Leaves:
    """The key paths of the gradient leaves, noted when the step is traced (static): the log
    line names an overflowing leaf by its index among them."""

    paths: tuple[str, ...] = ()

    def note(self, grads: Any) -> None:
        flat = jax.tree_util.tree_flatten_with_path(grads)[0]
        self.paths = tuple(jax.tree_util.keystr(p) for p, _ in flat)


class Teller:
    """Writes, in ``logger``, the first skipped step (what was not finite, what the policy
    did) and a run that is stuck, each once, from :func:`why`'s vectors already on the host
    (no sync of its own). ``who``: the trainer, as the line names it; ``leaves``: the
    gradient leaves' paths, noted when the step was traced."""

    def __init__(self, logger: logging.Logger, who: str, leaves: Leaves | None = None) -> None:
        self.logger, self.who, self.leaves = logger, who, leaves
        self.told_first = self.told_stuck = False
        self.in_a_row = 0

    def seen(self, vectors: Sequence[Any]) -> bool:
        """Reads one optimizer step's vectors (one per micro-batch of its window, in order)
        and says what is to be said; whether the step was skipped."""
        rows: list[dict[str, float]] = [
            dict(zip(WHY, np.asarray(v, np.float64).tolist(), strict=True)) for v in vectors
        ]
        last = dict(rows[-1])  # after the window's decision
        last["loss_finite"] = min(r["loss_finite"] for r in rows)  # any micro-batch's
        last["scale_used"] = rows[0]["scale_used"]
        skipped = bool(last["skipped"])
        helpless = not last["loss_finite"] or bool(last["stuck"])
        self.in_a_row = self.in_a_row + 1 if skipped and helpless else 0
        if skipped and not self.told_first:
            self.told_first = True
            paths = self.leaves.paths if self.leaves is not None else ()
            self.logger.warning("lossscale_jax: %s", first_skip(self.who, last, paths))
        if self.in_a_row >= STUCK_AFTER and not self.told_stuck:
            self.told_stuck = True
            self.logger.warning("lossscale_jax: %s", stuck(self.who, last, self.in_a_row))
        return skipped


def first_skip(who: str, why: dict[str, float], paths: tuple[str, ...]) -> str:
    """The line said at the first skipped step: what was not finite, what the policy did."""
    used, now = why["scale_used"], why["loss_scale"]
    if not why["loss_finite"]:
        what = (
            "its loss itself was not finite (inf or nan) before any loss scale touched it, "
            "so its gradients were not either"
        )
    elif why["unlanded"]:
        what = (
            "its update would have written inf or nan into a float16 parameter (the "
            "gradients were finite: the inner optimizer runs in float16)"
        )
    else:
        count, first = int(why["overflow_leaves"]), int(why["first_overflow_leaf"])
        named = ""
        if 0 <= first < len(paths):
            others = f" and {count - 1} other(s)" if count > 1 else ""
            named = f": the gradient of {paths[first]}{others}"
        what = f"its gradients, scaled by {used:.8g}, overflowed (inf or nan){named}"
    line = (
        f"{who} skipped an optimizer step: {what}. Nothing was applied (the parameters and "
        "the optimizer's state and step are as they were). "
    )
    if now < used:
        line += f"The loss scale backed off from {used:.8g} to {now:.8g} (loss_scale/loss_scale)"
        if not why["loss_finite"]:
            line += (
                ", which cannot help: no loss scale makes a non-finite loss finite; look at "
                "the batch and the model's forward pass."
            )
        else:
            line += (
                ". A dynamic scale starts high and halves until the gradients fit: the "
                "first steps of a fresh model often skip."
            )
    elif now > used:
        line += f"The loss scale moved from {used:.8g} to {now:.8g} (loss_scale/loss_scale)."
    else:
        line += f"The loss scale stayed at {used:.8g} (loss_scale/loss_scale)"
        if not why["loss_finite"]:
            line += (
                "; no loss scale makes a non-finite loss finite: look at the batch and the "
                "model's forward pass."
            )
        elif why["stuck"] and used == 1.0:
            line += (
                ": no loss scale was applied, so the gradients overflowed in the compute "
                "dtype itself; a scale does not help unless it is below 1 (a smaller "
                "loss, or lsj.StaticScale below 1)."
            )
        elif why["stuck"]:
            line += (
                ": this policy does not lower it (a fixed scale, or a dynamic one at its "
                "floor), so the same gradients overflow again; a lower scale, or "
                "lsj.DynamicScale(), lets them fit."
            )
        else:
            line += " (a dynamic scale with hysteresis backs off after more overflows)."
    return line + " loss_scale/skipped_steps counts every skip. Said once per trainer."


def stuck(who: str, why: dict[str, float], in_a_row: int) -> str:
    """The line said when the run is stuck: every recent step skipped, no scale to fix it."""
    if not why["loss_finite"]:
        cause = "the loss itself is not finite, which no loss scale fixes"
    else:
        cause = (
            f"the gradients overflow at a loss scale of {why['loss_scale']:.8g}, which this "
            "policy does not lower (a fixed scale, or a dynamic one at its floor)"
        )
    return (
        f"{who} is stuck: its last {in_a_row} optimizer steps were all skipped, nothing "
        f"applied, and {cause}. Every further step will skip the same way; stop the run and "
        "fix the cause. Said once per trainer."
    )
