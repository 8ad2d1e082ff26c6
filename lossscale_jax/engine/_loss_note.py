"""What ``scale_loss`` saw of the loss, for the update of the same step.

The loss is the one tap every step has: its cotangent is the scale itself, in the loss's
dtype, so a float16 loss overflows at a scale of 2**16 whatever the parameter gradients show.
Inside ``lsj.taps.value_and_grad`` the loss's tap reports that; without taps nothing would,
and ``HeadroomScale``, which sets the scale from the measured range, would keep climbing into
that ceiling. So ``scale_loss`` notes the loss's dtype against the scale array it multiplied
by (while the step is traced: the array, or the tracer, of that step's state), and the engine,
given that same scale array by the update, reads the note: what the loss's tap would have
said, measured on the scale alone (:func:`loss_tap`).

The note is a weak reference to the scale array with the dtype; a few of the latest are kept.
An update given another array (a state rebuilt between the two calls) finds no note and
measures the gradients alone, as before.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import numpy as np

from lossscale_jax.engine._tap_stats import TapStats, measure_backward

_KEEP = 32
_NOTES: list[tuple[weakref.ref, np.dtype]] = []


def note(scale: Any, loss_dtype: Any) -> None:
    """``scale_loss`` multiplied a loss of ``loss_dtype`` by ``scale``."""
    try:
        ref = weakref.ref(scale)
    except TypeError:  # not an array (a Python number): nothing to match later
        return
    _NOTES.append((ref, np.dtype(loss_dtype)))
    del _NOTES[:-_KEEP]


def loss_dtype(scale: Any) -> np.dtype | None:
    """The dtype of the loss ``scale_loss`` last multiplied by this very ``scale``, if any."""
    for ref, dtype in reversed(_NOTES):
        if ref() is scale:
            return dtype
    return None


def loss_tap(scale: jax.Array, dtype: np.dtype) -> TapStats:
    """The statistics the loss's tap would record: its cotangent is ``scale`` in ``dtype``."""
    return TapStats(("loss",), (dtype.name,), [measure_backward(scale.astype(dtype))])
