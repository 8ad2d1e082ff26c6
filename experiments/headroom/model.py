"""A NumPy model of the headroom rule: set the loss scale from the gradients' own range.

Plain Python on ``np.float32`` scalars, one step at a time; the reference that the JAX
prototype (``proto.py``) and the library policy are checked against.

Statistic (measured by the overflow check, in the same pass): ``amax``, the largest
|scaled gradient| over every parameter gradient, divided by ``scale * limit`` (``limit`` =
finfo(compute_dtype).max, 65504 for float16): the fraction of the compute dtype's range the
gradients would fill at scale 1, so ``1 / amax`` is the largest scale they leave room for.

Rule (one step; ``overflow`` and ``amax`` already reduced across devices)::

  def target(peak, margin):                # a power of two: the unscale stays exact
      return 2 ** (floor(log2(1 / peak)) - margin)

  if overflow:                             # amax is inf/nan/65504 here: not used
      good = 0
      if peak == 0:                        # nothing measured yet: init_scale was a guess
          scale = scale * blind_backoff
      else:                                # the measured headroom was not enough
          if margin < max_margin:
              margin += 1
          else:                            # the margin is spent: remember the overflow
              peak = max(peak, 1 / scale)  # (that batch filled the range at `scale`)
          scale = min(scale / 2, target(peak, margin))
  else:
      peak = max(amax, peak * decay)       # held peak, decay = 2 ** (-1 / window)
      good += 1
      if good >= margin_interval and margin > min_margin:
          margin -= 1                      # give an octave back after a long good run
          good = 0
      scale = target(peak, margin) if peak > 0 else scale * 2
  scale = clip(scale, min_scale, max_scale)

``peak == 0`` after a good step means gradients that were all zero: no information, so the
scale doubles, as a growth with no measurement would.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

f32 = np.float32


@dataclasses.dataclass(frozen=True)
class Headroom:
    """Hyperparameters (static)."""

    init_scale: float = 2.0**15
    min_margin: int = 1
    max_margin: int = 8
    margin_interval: int = 2000
    window: float = 100.0  # steps for the held peak to fall by one octave
    blind_backoff: float = 2.0**-8
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    grow_margin: bool = True  # margin += 1 after an informed overflow
    # peak = max(peak, 1 / scale) after an informed overflow: "spent" (once the margin is at
    # max_margin; the rule), "always", or "never"
    bump: str = "spent"

    @property
    def decay(self) -> np.float32:
        return f32(2.0 ** (-1.0 / self.window))

    def init(self) -> dict:
        return dict(
            scale=f32(self.init_scale),
            peak=f32(0.0),
            margin=np.int32(self.min_margin),
            good=np.int32(0),
        )


def target(peak: np.float32, margin: int) -> np.float32:
    """``2 ** (floor(log2(1 / peak)) - margin)`` in float32 (inf when 1/peak is)."""
    inv = f32(1.0) / f32(peak)
    if not np.isfinite(inv):
        return f32(np.inf)
    _, exp = np.frexp(inv)
    e = int(exp) - 1 - int(margin)
    return f32(math.ldexp(1.0, e)) if e < 128 else f32(np.inf)


def step(h: Headroom, s: dict, overflow: bool, amax: float) -> dict:
    """One step of the rule; ``amax`` is ignored when ``overflow``."""
    scale, peak, margin, good = s["scale"], s["peak"], int(s["margin"]), int(s["good"])
    if overflow:
        good = 0
        if peak == 0:
            new = f32(scale * f32(h.blind_backoff))
        else:
            spent = margin >= h.max_margin or not h.grow_margin
            if h.grow_margin:
                margin = min(margin + 1, h.max_margin)
            if h.bump == "always" or (h.bump == "spent" and spent):
                peak = max(peak, f32(f32(1.0) / scale))
            new = min(f32(scale * f32(0.5)), target(peak, margin))
    else:
        peak = max(f32(amax), f32(peak * h.decay))
        good += 1
        if good >= h.margin_interval and margin > h.min_margin:
            margin -= 1
            good = 0
        new = target(peak, margin) if peak > 0 else f32(scale * f32(2.0))
    hi = f32(min(h.max_scale, float(np.finfo(np.float32).max)))
    new = f32(min(max(new, f32(h.min_scale)), hi))
    return dict(scale=new, peak=f32(peak), margin=np.int32(margin), good=np.int32(good))
