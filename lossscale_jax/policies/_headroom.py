"""``HeadroomScale``: the loss scale set from the gradients' own range."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from lossscale_jax.engine import _hyper
from lossscale_jax.engine._ops import where
from lossscale_jax.engine._policy import LossScalePolicy, as_overflow
from lossscale_jax.engine._state import (
    LossScaleState,
    clamp,
    initial_state,
    record_step,
    safe_increment,
    with_scale,
)


def pow2_target(peak: jax.Array, margin: jax.Array) -> jax.Array:
    """``2 ** (floor(log2(1 / peak)) - margin)`` in float32, exactly (frexp, ldexp).

    ``inf`` when ``1 / peak`` is (``peak`` 0 or subnormal): the clip to
    ``max_scale`` that follows turns it into the cap.
    """
    inv = jnp.float32(1.0) / peak
    _, exp = jnp.frexp(inv)
    e = exp.astype(jnp.int32) - 1 - margin
    out = jnp.ldexp(jnp.float32(1.0), jnp.minimum(e, 128))
    return where(jnp.isfinite(inv), out, jnp.float32(jnp.inf))


@dataclasses.dataclass(frozen=True)
class HeadroomScale(LossScalePolicy):
    """A loss scale set from the gradients' own range: grows without overflowing to probe.

    The overflow check also measures ``amax``, the largest magnitude of the
    scaled gradients over every parameter, in the same pass (and, under
    ``axis_name``, in the same collective as the flag). Divided by the scale
    and by ``finfo(compute_dtype).max`` (65504 for float16), it is the fraction
    of the compute dtype's range the gradients would fill at scale 1, so
    ``1 / amax`` is the largest scale they leave room for. The policy keeps a
    held peak of it and sets the scale a power of two (the unscale stays
    exact) ``margin`` octaves below that room. An overflow (intermediate
    activation gradients can overflow before any parameter gradient does)
    still skips the step and widens the margin by an octave; a long run of
    good steps gives the octave back. Once the margin is at ``max_margin``, an
    overflow enters ``1 / scale`` into the peak instead (the range that batch
    needed at least), so the scale comes back to the overflowing one only as
    that peak decays, never at once. It never raises the scale to
    find out whether a larger one is safe, so a run at its ceiling does not
    skip a step every ``growth_interval`` as ``DynamicScale`` does.

    It keeps room for what the check measures: the parameter gradients, and
    the taps when the step passes them (``tx.update(..., taps=stats)`` from
    ``lsj.taps.value_and_grad``; each tap against its own dtype's largest
    value). Where the parameter gradients say nothing about the ceiling it
    cannot see it: a float16 loss, whose cotangent is the scale itself,
    overflows at 2**16 whatever the gradients show; without taps the policy
    then overflows and widens its margin one octave at a time, and can run
    many octaves below the ceiling. ``lsj.scale_loss`` taps the loss, so with
    taps that ceiling is measured like any other (docs/core.md has the numbers).

    Rule (one step; ``overflow`` and ``amax`` already reduced across devices)::

      target(peak, margin) = 2 ** (floor(log2(1 / peak)) - margin)
      if overflow:                               # amax is inf/nan/65504: not used
          growth_count = 0
          if range_peak == 0:                    # nothing measured yet
              scale = scale * blind_backoff
          else:                                  # the measured room was not enough
              if margin < max_margin:
                  margin += 1
              else:                              # the margin is spent: remember the overflow
                  range_peak = max(range_peak, 1 / scale)   # (that batch filled the range)
              scale = min(scale / 2, target(range_peak, margin))
      else:
          range_peak = max(amax, range_peak * 2 ** (-1 / window))   # held peak
          growth_count += 1
          if growth_count >= margin_interval and margin > min_margin:
              margin -= 1                        # give an octave back
              growth_count = 0
          if range_peak > 0:
              scale = target(range_peak, margin)  # up or down, in one step
          else:
              scale = scale * 2                  # all-zero gradients: no information
      scale = clip(scale, min_scale, max_scale)

    ``amax`` is ``max |scaled g| / (scale * finfo(compute_dtype).max)``, in
    float32 (a value that is not finite or < 0 counts as 0: no measurement).
    A state with a scale outside ``[min_scale, max_scale]`` or a margin
    outside ``[min_margin, max_margin]`` is brought into range by its next step
    (``conform`` does it without a step). ``stuck`` is set when an overflow
    finds the scale already at ``min_scale``.

    Args:
      init_scale: the scale of the first step (``[min_scale, max_scale]``).
        The first good step replaces it with the measured target, so a low
        value costs one step's underflow, a high one a skipped step.
      min_margin: octaves kept below the measured room at least (int >= 0).
      max_margin: the widest margin overflows can push it to (int >=
        ``min_margin``).
      margin_interval: good steps in a row after which a widened margin gives
        one octave back (int >= 1; ``DynamicScale``'s default growth interval).
      window: steps over which the held peak falls by one octave (int >= 1):
        how long a large gradient is remembered.
      blind_backoff: factor in (0, 1) applied on an overflow before anything
        was measured (``init_scale`` too high).
      min_scale: floor of the scale (> 0).
      max_scale: cap of the scale (>= min_scale; ``float("inf")`` means only
        float32's range caps it).

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale_jax as lsj
      >>> policy = lsj.HeadroomScale(init_scale=2.0**10)
      >>> s = policy.init()
      >>> s = policy.adjust(s, False, amax=jnp.float32(2.0**-20))  # room for 2**20
      >>> float(s.scale) == 2.0**19                               # one octave of margin
      True
      >>> s = policy.adjust(s, True, amax=jnp.float32(jnp.inf))   # overflow: skip, widen
      >>> float(s.scale) == 2.0**18, int(s.margin), bool(s.last_skipped)
      (True, 2, True)

    References:
      Micikevicius et al, `Mixed Precision Training
      <https://arxiv.org/abs/1710.03740>`_, 2018; NVIDIA Transformer Engine,
      delayed scaling of float8 tensors from an amax history.
    """

    init_scale: float = 2.0**15
    min_margin: int = 1
    max_margin: int = 8
    margin_interval: int = 2000
    window: int = 100
    blind_backoff: float = 2.0**-8
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    measures_range: ClassVar[bool] = True

    def __post_init__(self) -> None:
        min_margin = _hyper.check_int("min_margin", self.min_margin, 0)
        max_margin = _hyper.check_int("max_margin", self.max_margin, 0)
        if max_margin < min_margin:
            raise ValueError(
                f"max_margin ({self.max_margin!r}) must be >= min_margin ({self.min_margin!r})."
            )
        if max_margin > 64:
            raise ValueError(
                f"max_margin must be an int in [min_margin, 64] (octaves), got {self.max_margin!r}."
            )
        interval = _hyper.check_int("margin_interval", self.margin_interval, 1)
        window = _hyper.check_int("window", self.window, 1)
        backoff = _hyper.check_real("blind_backoff", self.blind_backoff)
        if not 0.0 < backoff < 1.0:
            raise ValueError(f"blind_backoff must be in (0, 1), got {self.blind_backoff!r}.")
        min_scale, max_scale, init_scale = _hyper.check_scale_range(
            self.min_scale, self.max_scale, self.init_scale
        )
        _hyper.store(
            self,
            init_scale=init_scale,
            min_margin=min_margin,
            max_margin=max_margin,
            margin_interval=interval,
            window=window,
            blind_backoff=backoff,
            min_scale=min_scale,
            max_scale=max_scale,
        )

    @property
    def decay(self) -> float:
        """The held peak's factor per good step, ``2 ** (-1 / window)`` (as float32 uses it)."""
        return float(np.float32(2.0 ** (-1.0 / self.window)))

    def init(self) -> LossScaleState:
        return initial_state(self.init_scale).replace(
            margin=jnp.asarray(self.min_margin, jnp.int32)
        )

    def adjust(
        self, state: LossScaleState, overflow: ArrayLike, amax: ArrayLike | None = None
    ) -> LossScaleState:
        """The state after one step; ``amax`` is the step's measured range (see the rule)."""
        if amax is None:
            raise TypeError(
                "HeadroomScale.adjust needs amax=, the step's max |scaled gradient| / (scale * "
                "finfo(compute_dtype).max) measured by the overflow check: loss_scaling and "
                "loss_scaling_multi_steps pass it; a hand-written step can take it from "
                "lossscale_jax.check_overflow_and_range."
            )
        overflow = as_overflow(overflow)
        amax = jnp.asarray(amax)
        if amax.shape != ():
            raise ValueError(f"amax must be a scalar, got shape {amax.shape}.")
        f32, i32 = jnp.float32, jnp.int32
        amax = amax.astype(f32)
        amax = where(jnp.logical_and(jnp.isfinite(amax), amax >= 0), amax, f32(0.0))
        scale = state.scale
        peak = state.range_peak.astype(f32)
        peak = where(jnp.logical_and(jnp.isfinite(peak), peak >= 0), peak, f32(0.0))
        margin = jnp.clip(state.margin, self.min_margin, self.max_margin).astype(i32)
        zero = jnp.zeros([], i32)

        # Overflow branch.
        blind = peak == 0
        spent = margin >= self.max_margin
        widened = jnp.minimum(margin + 1, self.max_margin).astype(i32)
        margin_bad = where(blind, margin, widened)
        remember = jnp.logical_and(jnp.logical_not(blind), spent)
        peak_bad = where(remember, jnp.maximum(peak, f32(1.0) / scale), peak)
        informed = jnp.minimum(scale * f32(0.5), pow2_target(peak_bad, margin_bad))
        scale_bad = where(blind, scale * f32(self.blind_backoff), informed)

        # Good branch.
        peak_good = jnp.maximum(amax, peak * f32(self.decay))
        count = safe_increment(state.growth_count)
        give_back = jnp.logical_and(count >= self.margin_interval, margin > self.min_margin)
        margin_good = where(give_back, margin - 1, margin).astype(i32)
        count = where(give_back, zero, count)
        scale_good = where(peak_good > 0, pow2_target(peak_good, margin_good), scale * f32(2.0))

        new_scale = where(overflow, scale_bad, scale_good)
        at_floor = scale <= f32(self.min_scale)
        return record_step(
            state,
            overflow,
            overflow,
            stuck=jnp.logical_and(overflow, at_floor),
            scale=clamp(new_scale, self.min_scale, self.max_scale),
            growth_count=where(overflow, zero, count),
            hysteresis_count=zero,
            range_peak=where(overflow, peak_bad, peak_good),
            margin=where(overflow, margin_bad, margin_good),
        )

    def conform(self, state: LossScaleState) -> LossScaleState:
        """``state`` with its scale clipped into ``[min_scale, max_scale]`` (nan: ``min_scale``)
        and its margin into ``[min_margin, max_margin]``.

        See ``LossScalePolicy.conform``; the held peak is kept (one that is not
        finite or < 0 becomes 0, nothing measured).
        """
        new = with_scale(state, clamp(state.scale, self.min_scale, self.max_scale))
        peak = state.range_peak.astype(jnp.float32)
        ok = jnp.logical_and(jnp.isfinite(peak), peak >= 0)
        return new.replace(
            margin=jnp.clip(state.margin, self.min_margin, self.max_margin).astype(jnp.int32),
            range_peak=where(ok, peak, jnp.float32(0.0)),
        )
