"""The loss scale's metrics, named for a host's logger, and the first skip said once.

A host logs a dict of scalars per step (EasyDeL's ``LossMetrics.other_metrics``, Tunix's
metrics buffer); :func:`scale_metrics` gives the loss scale's, computed on the device after
the step's update (no host sync): ``loss_scale/loss_scale``, ``loss_scale/skipped``,
``loss_scale/skipped_steps`` and ``loss_scale/overflow_rate``. :class:`FirstSkip` writes one
log line the first time a step the host logged was skipped, saying why.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np

from lossscale_jax.access._metrics import metrics

PREFIX = "loss_scale/"
KEYS = ("loss_scale", "skipped", "skipped_steps", "overflow_rate")


def scale_metrics(opt_state: Any, prefix: str = PREFIX) -> dict[str, jax.Array]:
    """The loss scale's metrics of ``opt_state`` (after the update), keyed ``prefix + key``."""
    now = metrics(opt_state)
    return {prefix + k: now[k] for k in KEYS}


class FirstSkip:
    """Says in a log line of ``logger`` the first time :meth:`seen` is given a skipped
    step's flag (a value already on the host: no sync of its own)."""

    def __init__(self, logger: logging.Logger, who: str) -> None:
        self.logger, self.who, self.told = logger, who, False

    def seen(self, skipped: Any) -> None:
        if self.told or not bool(np.asarray(skipped)):
            return
        self.told = True
        self.logger.warning(
            "lossscale_jax: %s skipped an optimizer step: its scaled gradients overflowed "
            "(inf or nan), so nothing was applied (the parameters and the optimizer's state "
            "as they were) and the loss scale backed off (loss_scale/loss_scale). A dynamic "
            "scale starts high and halves until the gradients fit: the first steps of a "
            "fresh model often skip, and loss_scale/skipped_steps counts every skip. Said "
            "once per trainer.",
            self.who,
        )
