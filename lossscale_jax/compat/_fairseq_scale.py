"""The scale rule of fairseq's and metaseq's ``DynamicLossScaler`` as one policy.

Re-exported through ``compat.fairseq`` and ``compat.metaseq`` (see their docstrings):
both grow after ``scale_window`` good steps since the last overflow, back off on an
overflow (on every one with ``tolerance=0``; with ``tolerance > 0`` once the overflows since
the last backoff reach ``tolerance`` times the iterations since the last rescale), floor a
backoff at ``threshold`` and refuse to go below ``min_loss_scale``. metaseq also doubles
(halves) the window with each growth (backoff).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from lossscale_jax.compat._common import _TINY, _int, _number
from lossscale_jax.engine._ops import where
from lossscale_jax.engine._ratio import RatioThreshold
from lossscale_jax.engine._state import (
    I32_MAX,
    LossScaleState,
    initial_state,
    keep_policy_state,
    record_step,
    safe_increment,
    with_scale,
)
from lossscale_jax.policies import LossScalePolicy

_F32 = np.float32


def _f32_below(x: float) -> float:
    """The largest float32 <= ``x``: ``s <= x`` iff ``s <= _f32_below(x)`` for a float32 ``s``."""
    y = _F32(x)
    return float(np.nextafter(y, _F32(-np.inf))) if float(y) > x else float(y)


def _f32_above(x: float) -> float:
    """The smallest float32 >= ``x``: ``s < x`` iff ``s < _f32_above(x)`` for a float32 ``s``."""
    y = _F32(x)
    return float(np.nextafter(y, _F32(np.inf))) if float(y) < x else float(y)


def check_args(
    init_scale: float,
    scale_factor: float,
    scale_window: int,
    tolerance: float,
    threshold: float | None,
    min_loss_scale: float,
    peer: str,
) -> tuple[float, float, int, float, float | None, float]:
    """The arguments as Python numbers, or the ``ValueError``/``TypeError`` naming the bad one."""
    init = _number("init_scale", init_scale)
    if not (math.isfinite(float(_F32(init))) and init > 0.0):
        raise ValueError(f"init_scale must be a finite float32 number > 0, got {init_scale!r}.")
    factor = _number("scale_factor", scale_factor)
    if not (math.isfinite(factor) and factor > 1.0):
        raise ValueError(f"scale_factor must be a finite number > 1, got {scale_factor!r}.")
    window = _int("scale_window", scale_window)
    if window < 1:
        raise ValueError(f"scale_window must be an int >= 1, got {scale_window!r}.")
    tol = _number("tolerance", tolerance)
    if not math.isfinite(tol):
        raise ValueError(
            f"tolerance must be a finite number (the fraction of iterations that may overflow "
            f"before {peer} backs off; 0 backs off on every overflow), got {tolerance!r}."
        )
    if threshold is not None:
        threshold = _number("threshold", threshold)
        if not (math.isfinite(threshold) and threshold >= 0.0):
            raise ValueError(f"threshold must be None or a finite number >= 0, got {threshold!r}.")
    lo = _number("min_loss_scale", min_loss_scale)
    if not (math.isfinite(lo) and lo >= 0.0):
        raise ValueError(f"min_loss_scale must be a finite number >= 0, got {min_loss_scale!r}.")
    return init, factor, window, max(tol, 0.0), threshold, lo


_ITERS = "iter_since_rescale"
_OVERFLOWS = "overflows_since_rescale"


@dataclasses.dataclass(frozen=True)
class FairseqScale(LossScalePolicy):
    """fairseq's (``metaseq=False``) or metaseq's ``DynamicLossScaler`` rule.

    Rule (one step; float32 scale; ``a`` = good steps since the last overflow; ``r`` =
    iterations since the last rescale, this one counted; ``o`` = overflows since the last
    backoff)::

      if overflow:                                  # the update is skipped
          o += 1
          backoff = o / float(r) >= tolerance       # float64, as in fairseq; always at 0
          new = scale
          if backoff:
              new = scale / scale_factor
              if threshold is not None: new = max(new, threshold)
              if metaseq: window = max(window // scale_factor, 1)
              o = 0; r = 0                          # a rescale
          if new <= min_loss_scale (fairseq) / new < min_loss_scale (metaseq):
              new = scale                           # fairseq raises FloatingPointError
          scale = new; a = 0
      else:
          a += 1
          if a % window == 0:                       # fairseq: window = scale_window
              scale = scale * scale_factor          # refused if not finite in float32
              if metaseq: window = window * scale_factor
              r = 0                                 # a rescale (o is kept, as in fairseq)
      r += 1

    ``stuck`` is set by the overflow fairseq raises ``FloatingPointError`` at, and by a
    backoff that leaves the scale where it was (metaseq's skip at its minimum, or the
    scale pinned at ``threshold``). A scale below ``2**-126`` counts as below
    ``min_loss_scale``. After fairseq's ``FloatingPointError`` (where fairseq stops) the
    rule goes on as after any overflow.

    State: ``growth_count`` holds ``a`` (fairseq: ``a % scale_window``; metaseq: ``a``
    itself, since its window changes); metaseq keeps its window in ``hysteresis_count``
    (a count of 0 or less, as in a state made by another policy, reads as
    ``scale_window``, the window a fresh or reloaded metaseq scaler has). fairseq keeps
    ``hysteresis_count`` at 0. With ``tolerance > 0``, ``policy_state`` holds ``r`` and
    ``o`` as ``{"iter_since_rescale", "overflows_since_rescale"}`` (int32; 1 and 0 when
    fresh, as fairseq starts them); with ``tolerance = 0`` it is ``None`` (the rule needs
    neither).
    """

    init_scale: float = 2.0**15
    scale_factor: float = 2.0
    scale_window: int = 2000
    threshold: float | None = None
    min_loss_scale: float = 1e-4
    metaseq: bool = False
    tolerance: float = 0.0

    def _fresh_own(self) -> dict[str, jax.Array] | None:
        """The counters ``tolerance > 0`` needs, as a fresh scaler has them."""
        if self.tolerance <= 0.0:
            return None
        return {_ITERS: jnp.ones([], jnp.int32), _OVERFLOWS: jnp.zeros([], jnp.int32)}

    def init(self) -> LossScaleState:
        state = initial_state(self.init_scale, self._fresh_own())
        if self.metaseq:
            state = state.replace(hysteresis_count=jnp.asarray(self.scale_window, jnp.int32))
        return state

    def adjust(
        self, state: LossScaleState, overflow: ArrayLike, amax: ArrayLike | None = None
    ) -> LossScaleState:
        overflow = jnp.asarray(overflow)
        if overflow.shape != ():
            raise ValueError(f"overflow must be a scalar, got shape {overflow.shape}.")
        overflow = overflow.astype(jnp.bool_)
        state = keep_policy_state(state, self._fresh_own())
        own: Any = state.policy_state
        f32, i32 = jnp.float32, jnp.int32
        scale = state.scale
        factor = jnp.asarray(self.scale_factor, f32)
        zero = jnp.zeros([], i32)
        window = jnp.asarray(self.scale_window, i32)
        if self.metaseq:
            window = where(state.hysteresis_count > 0, state.hysteresis_count, window)

        # Overflow branch.
        if own is None:
            seen = zero  # not kept
            backoff = jnp.ones([], jnp.bool_)
        else:
            seen = safe_increment(jnp.maximum(own[_OVERFLOWS], zero))
            backoff = RatioThreshold(self.tolerance).at_least(seen, own[_ITERS])
        new = scale / factor
        if self.threshold is not None:
            new = jnp.maximum(new, jnp.asarray(self.threshold, f32))
        new = where(backoff, new, scale)
        if self.metaseq:
            too_low = new < jnp.asarray(max(_f32_above(self.min_loss_scale), _TINY), f32)
        else:
            too_low = jnp.logical_or(
                new <= jnp.asarray(_f32_below(self.min_loss_scale), f32),
                new < jnp.asarray(_TINY, f32),
            )
        bad_scale = where(too_low, scale, new)
        pinned = jnp.logical_and(backoff, jnp.logical_not(bad_scale < scale))
        # fairseq raises FloatingPointError at its minimum, whether or not it backed off.
        stuck = pinned if self.metaseq else jnp.logical_or(pinned, too_low)
        factor_i = int(self.scale_factor)  # metaseq's factor is a whole number (checked)
        halved = jnp.maximum(window // factor_i, 1).astype(i32)
        bad_window = where(backoff, halved, window)

        # Good branch.
        good = safe_increment(jnp.maximum(state.growth_count, zero))
        # metaseq's window changes, so it counts on past a growth; fairseq's count restarts.
        grow = good % window == 0 if self.metaseq else good >= window
        grown = scale * factor
        grow_ok = jnp.logical_and(grow, jnp.isfinite(grown))
        good_scale = where(grow_ok, grown, scale)
        if self.metaseq:
            wider = where(window > I32_MAX // factor_i, I32_MAX, window * factor_i)
            good_window = where(grow_ok, wider, window).astype(i32)
            hyst = where(overflow, bad_window, good_window)
            good_count = good
        else:
            hyst = zero
            good_count = where(grow, zero, good)

        changes: dict[str, Any] = {}
        if own is not None:
            rescaled = where(overflow, backoff, grow)
            one = jnp.ones([], i32)
            changes["policy_state"] = {
                _ITERS: where(rescaled, one, safe_increment(own[_ITERS])),
                _OVERFLOWS: where(overflow, where(backoff, zero, seen), own[_OVERFLOWS]).astype(
                    i32
                ),
            }
        new_scale = where(overflow, bad_scale, good_scale)
        return record_step(
            state,
            overflow,
            overflow,
            stuck=jnp.logical_and(overflow, stuck),
            scale=new_scale,
            growth_count=where(overflow, zero, good_count),
            hysteresis_count=hyst,
            **changes,
        )

    def conform(self, state: LossScaleState) -> LossScaleState:
        """``state`` unchanged if its scale is a finite float32 number > 0, else at ``init_scale``.

        fairseq and metaseq have no cap and floor the scale only on a backoff, so any
        such scale is one they can hold. ``policy_state`` is this policy's (fresh if the
        state was made by another policy).
        """
        state = keep_policy_state(state, self._fresh_own())
        scale = state.scale
        ok = jnp.logical_and(jnp.isfinite(scale), scale > 0)
        return with_scale(state, where(ok, scale, jnp.asarray(self.init_scale, jnp.float32)))
