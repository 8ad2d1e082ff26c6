"""``DynamicScale``: back off on overflow, grow after a run of good steps (with hysteresis)."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
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

_GROWTH_OVERFLOW: tuple[str, ...] = ("refuse", "clamp")


@dataclasses.dataclass(frozen=True)
class DynamicScale(LossScalePolicy):
    """Dynamic loss scaling: back off on overflow, grow after a run of good steps.

    Rule (one step; ``overflow`` already reduced across devices)::

      if overflow:                                  # the update is skipped
          growth_count = 0
          hysteresis_count += 1
          if hysteresis_count >= hysteresis:
              scale = max(scale * backoff_factor, min_scale)
              if not sticky_hysteresis:
                  hysteresis_count = 0
      else:
          growth_count += 1
          if consecutive_hysteresis:
              hysteresis_count = 0                  # overflows must come in a row
          if growth_count >= growth_interval:
              grown = scale * growth_factor         # in float32
              if growth_overflow == "clamp":
                  scale = min(grown, max_scale)     # inf clamps to max_scale
              elif isfinite(grown):
                  scale = min(grown, max_scale)     # refused when not finite
              growth_count = 0
              hysteresis_count = 0                  # the scale changed

    With ``consecutive_hysteresis=False``, overflows accumulate until the
    scale next changes (a backoff or a growth), whatever good steps lie
    between them. With ``hysteresis=1`` both modes back off on every
    overflow. All arithmetic is float32, like the state.

    The new scale is always in ``[min_scale, max_scale]``: a state whose scale
    lies outside (restored from a checkpoint, or made by another policy) is
    brought into the range by its next step, ``scale = clip(scale,
    min_scale, max_scale)`` after the rule above (nan goes to ``min_scale``).
    For a state inside the range that clip changes nothing.

    With ``sticky_hysteresis=True`` a backoff does not reset the overflow
    count: once ``hysteresis`` overflows have been counted, every further
    overflow backs off until the count is reset (by a growth, or by a good
    step when ``consecutive_hysteresis``). This is the delayed shift of
    DeepSpeed's ``DynamicLossScaler`` and the hysteresis tracker of
    Megatron-LM's ``DynamicGradScaler``. In that mode ``stuck`` is set only
    when a backoff was due with the scale at ``min_scale`` (DeepSpeed's
    "cannot decrease scale anymore" condition).

    Args:
      init_scale: the starting scale, in ``[min_scale, max_scale]``.
      growth_factor: factor > 1 applied after ``growth_interval`` good steps.
      backoff_factor: factor in (0, 1) applied on a backoff.
      growth_interval: good steps before a growth (int >= 1).
      hysteresis: overflows before a backoff (int >= 1).
      consecutive_hysteresis: count only overflows in a row (True) or all
        overflows since the scale last changed (False).
      min_scale: floor of the scale (> 0).
      max_scale: cap of the scale (>= min_scale; ``float("inf")`` means only
        float32's range caps it).
      sticky_hysteresis: keep the overflow count after a backoff (see above).
        Default False.
      growth_overflow: what a growth does whose float32 result is not finite:
        ``"refuse"`` (default; the scale stays) or ``"clamp"`` (the scale
        becomes ``max_scale``, which must then be finite; Flax's rule).

    Examples:
      >>> import lossscale_jax as lsj
      >>> policy = lsj.DynamicScale(init_scale=8.0, growth_interval=2)
      >>> s = policy.init()
      >>> s = policy.adjust(s, True)          # overflow: back off, skip
      >>> float(s.scale), bool(s.last_skipped)
      (4.0, True)
      >>> s = policy.adjust(policy.adjust(s, False), False)  # two good steps: grow
      >>> float(s.scale)
      8.0

    References:
      Micikevicius et al, `Mixed Precision Training
      <https://arxiv.org/abs/1710.03740>`_, 2018.
    """

    init_scale: float = 2.0**15
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    consecutive_hysteresis: bool = True
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    sticky_hysteresis: bool = False
    growth_overflow: str = "refuse"

    def __post_init__(self) -> None:
        growth, backoff, interval = _hyper.check_growth_rule(
            self.growth_factor, self.backoff_factor, self.growth_interval
        )
        hysteresis = _hyper.check_int("hysteresis", self.hysteresis, 1)
        consecutive = _hyper.check_bool("consecutive_hysteresis", self.consecutive_hysteresis)
        min_scale, max_scale, init_scale = _hyper.check_scale_range(
            self.min_scale, self.max_scale, self.init_scale
        )
        sticky = _hyper.check_bool("sticky_hysteresis", self.sticky_hysteresis)
        _hyper.check_choice("growth_overflow", self.growth_overflow, _GROWTH_OVERFLOW)
        if self.growth_overflow == "clamp" and not math.isfinite(max_scale):
            raise ValueError(
                f"growth_overflow='clamp' needs a finite max_scale, got {self.max_scale!r}."
            )
        _hyper.store(
            self,
            init_scale=init_scale,
            growth_factor=growth,
            backoff_factor=backoff,
            growth_interval=interval,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive,
            min_scale=min_scale,
            max_scale=max_scale,
            sticky_hysteresis=sticky,
        )

    def init(self) -> LossScaleState:
        return initial_state(self.init_scale)

    def adjust(
        self, state: LossScaleState, overflow: ArrayLike, amax: ArrayLike | None = None
    ) -> LossScaleState:
        overflow = as_overflow(overflow)
        f32 = jnp.float32
        scale = state.scale
        zero = jnp.zeros([], jnp.int32)

        # Overflow branch.
        hyst_bad = safe_increment(state.hysteresis_count)
        if self.sticky_hysteresis:
            hyst_bad = jnp.minimum(hyst_bad, jnp.asarray(self.hysteresis, jnp.int32))
        backoff = hyst_bad >= self.hysteresis
        backed_off = jnp.maximum(
            scale * jnp.asarray(self.backoff_factor, f32), jnp.asarray(self.min_scale, f32)
        )
        bad_scale = where(backoff, backed_off, scale)
        bad_hyst = hyst_bad if self.sticky_hysteresis else where(backoff, zero, hyst_bad)

        # Good branch.
        growth_good = safe_increment(state.growth_count)
        grow = growth_good >= self.growth_interval
        grown = scale * jnp.asarray(self.growth_factor, f32)
        capped = jnp.minimum(grown, jnp.asarray(self.max_scale, f32))
        if self.growth_overflow == "refuse":
            capped = where(jnp.isfinite(grown), capped, scale)
        good_scale = where(grow, capped, scale)
        good_growth = where(grow, zero, growth_good)
        keep_hyst = jnp.logical_and(jnp.logical_not(grow), not self.consecutive_hysteresis)
        good_hyst = where(keep_hyst, state.hysteresis_count, zero)

        at_floor = scale <= jnp.asarray(self.min_scale, f32)
        if self.sticky_hysteresis:
            at_floor = jnp.logical_and(at_floor, backoff)
        new_scale = where(overflow, bad_scale, good_scale)
        return record_step(
            state,
            overflow,
            overflow,
            stuck=jnp.logical_and(overflow, at_floor),
            scale=clamp(new_scale, self.min_scale, self.max_scale),
            growth_count=where(overflow, zero, good_growth),
            hysteresis_count=where(overflow, bad_hyst, good_hyst),
        )

    def conform(self, state: LossScaleState) -> LossScaleState:
        """``state`` with its scale clipped into ``[min_scale, max_scale]`` (nan: ``min_scale``).

        See ``LossScalePolicy.conform``: a scale inside the range is kept, so a
        run continues from where it is rather than from ``init_scale``.
        """
        return with_scale(state, clamp(state.scale, self.min_scale, self.max_scale))
