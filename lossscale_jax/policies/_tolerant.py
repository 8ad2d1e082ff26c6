"""``TolerantDynamicScale``: back off only when too many recent steps overflowed (Cerebras)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.typing import ArrayLike

from lossscale_jax.engine import _hyper
from lossscale_jax.engine._division import MAX_COUNT, divide_by_count
from lossscale_jax.engine._ops import where
from lossscale_jax.engine._policy import LossScalePolicy, as_overflow
from lossscale_jax.engine._state import (
    LossScaleState,
    clamp,
    increment_if,
    initial_state,
    record_step,
    safe_increment,
    with_scale,
)


@dataclasses.dataclass(frozen=True)
class TolerantDynamicScale(LossScalePolicy):
    """Dynamic loss scaling that backs off only when too many recent steps overflowed.

    Every overflowing step is skipped, but the scale is lowered only when the
    fraction of overflowing steps since the scale last changed exceeds
    ``overflow_tolerance`` (Cerebras ``cstorch.amp.GradScaler``). With
    ``overflow_tolerance=0`` every overflow backs off.

    Rule (one step; counters are the steps and overflows since the last change)::

      steps = growth_count + 1
      overflows = hysteresis_count + overflow
      if overflows / steps > overflow_tolerance:    # float32
          scale = scale * backoff_factor
          steps = overflows = 0
      if steps >= growth_interval:                  # good or bad steps alike
          grown = min(scale * growth_factor, max_scale)
          if isfinite(grown):
              scale = grown                         # refused when not finite
          steps = overflows = 0
      scale = min(max(scale, min_scale), max_scale)
      skipped = overflow

    ``growth_count`` holds ``steps`` and ``hysteresis_count`` holds
    ``overflows``. ``stuck`` is set when a backoff was due with the scale
    already at ``min_scale``. ``init_scale`` may lie outside
    ``[min_scale, max_scale]``; the first update clips it, as Cerebras does.

    Args:
      init_scale: the starting scale (a finite float > 0).
      growth_factor: factor > 1 applied after ``growth_interval`` steps.
      backoff_factor: factor in (0, 1) applied when the tolerance is exceeded.
      growth_interval: steps since the last change before a growth (int >= 1).
      overflow_tolerance: the largest fraction of overflowing steps (since the
        last change) that leaves the scale alone, in [0, 1].
      min_scale: floor of the scale (> 0).
      max_scale: cap of the scale (>= min_scale; may be ``float("inf")``).

    Examples:
      >>> import lossscale_jax as lsj
      >>> policy = lsj.TolerantDynamicScale(init_scale=8.0, overflow_tolerance=0.5)
      >>> s = policy.adjust(policy.init(), False)   # 0/1 overflowed
      >>> s = policy.adjust(s, True)                # 1/2: within tolerance, skipped
      >>> float(s.scale), bool(s.last_skipped)
      (8.0, True)
      >>> float(policy.adjust(s, True).scale)      # 2/3 > 0.5: back off
      4.0
    """

    init_scale: float = 2.0**15
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    overflow_tolerance: float = 0.0
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    def __post_init__(self) -> None:
        init_scale = _hyper.check_positive_finite("init_scale", self.init_scale)
        growth, backoff, interval = _hyper.check_growth_rule(
            self.growth_factor, self.backoff_factor, self.growth_interval
        )
        tolerance = _hyper.check_real("overflow_tolerance", self.overflow_tolerance)
        if not 0.0 <= tolerance <= 1.0:
            raise ValueError(
                f"overflow_tolerance must be in [0, 1], got {self.overflow_tolerance!r}."
            )
        min_scale, max_scale, _ = _hyper.check_scale_range(self.min_scale, self.max_scale)
        _hyper.store(
            self,
            init_scale=init_scale,
            growth_factor=growth,
            backoff_factor=backoff,
            growth_interval=interval,
            overflow_tolerance=tolerance,
            min_scale=min_scale,
            max_scale=max_scale,
        )

    def init(self) -> LossScaleState:
        return initial_state(self.init_scale)

    def adjust(
        self, state: LossScaleState, overflow: ArrayLike, amax: ArrayLike | None = None
    ) -> LossScaleState:
        overflow = as_overflow(overflow)
        f32 = jnp.float32
        zero = jnp.zeros([], jnp.int32)
        scale = state.scale
        lo = jnp.asarray(self.min_scale, f32)
        hi = jnp.asarray(self.max_scale, f32)

        steps = safe_increment(state.growth_count)
        overflows = increment_if(overflow, state.hysteresis_count)
        # Rounded once on every backend while the window fits divide_by_count (growth
        # intervals up to 4095 steps); a longer window takes the backend's quotient.
        exact = divide_by_count(overflows.astype(f32), jnp.clip(steps, 1, MAX_COUNT))
        ratio = where(steps <= MAX_COUNT, exact, overflows.astype(f32) / steps.astype(f32))
        backoff = ratio > jnp.asarray(self.overflow_tolerance, f32)
        scale_b = where(backoff, scale * jnp.asarray(self.backoff_factor, f32), scale)
        steps = where(backoff, zero, steps)
        overflows = where(backoff, zero, overflows)

        grow = steps >= self.growth_interval
        grown = jnp.minimum(scale_b * jnp.asarray(self.growth_factor, f32), hi)
        grown = where(jnp.isfinite(grown), grown, scale_b)
        scale_g = where(grow, grown, scale_b)
        steps = where(grow, zero, steps)
        overflows = where(grow, zero, overflows)

        new_scale = clamp(scale_g, self.min_scale, self.max_scale)
        stuck = jnp.logical_and(overflow, jnp.logical_and(backoff, scale <= lo))
        return record_step(
            state,
            overflow,
            overflow,
            stuck=stuck,
            scale=new_scale,
            growth_count=steps,
            hysteresis_count=overflows,
        )

    def conform(self, state: LossScaleState) -> LossScaleState:
        """``state`` with its scale clipped into ``[min_scale, max_scale]``.

        A state that has not stepped yet at ``init_scale`` is kept as it is:
        ``init_scale`` may lie outside the range until the first update clips
        it (see above). Otherwise as ``DynamicScale.conform``.
        """
        fresh = jnp.logical_and(
            state.total_steps == 0, state.scale == jnp.asarray(self.init_scale, jnp.float32)
        )
        clipped = clamp(state.scale, self.min_scale, self.max_scale)
        return with_scale(state, where(fresh, state.scale, clipped))
