"""The engine's rule in NumPy: check, reduce, adjust, select, over windows of micro-batches.

Written from the docstrings (``loss_scaling``, ``loss_scaling_multi_steps``, the policies,
``metrics``), not from the code, with NumPy scalars of the state's dtypes (float32 scale,
int32 counters) so that every comparison with the library can be bit for bit. One class,
``Reference``, steps one micro-batch at a time; a window of one micro-batch is
``loss_scaling``. The policies' rules are ``POLICY_RULES``, keyed by the policy's class name.

What it models, per call (``every_k`` micro-batches per window)::

  flags[leaf] = overflow(scaled leaf, mode)      # ieee / saturating / both
  found = any(flags) or scale not finite and > 0
  amax = max |scaled g| / (scale * finfo(compute_dtype).max)  (float32)
  window: overflow |= found; record |= flags; range = max(range, amax)
  if not found: acc += unscale(g)               # a bad micro-batch is left out
  last micro-batch of the window:
      mean = acc * float32(1/k) (k > 1) or unscale(g)
      landing[leaf] = the update of mean would make a float16 parameter inf or nan
                      (and the scale is finite and > 0)
      loss_scale = policy(loss_scale, window overflow, window range)
      if any(landing) and not skipped:             # unlanded: not an overflow
          loss_scale = as before the policy, the step recorded skipped and stuck
      if not window overflow: record |= landing
      if not skipped: updates, inner = inner(mean)
      else: updates = -0.0, inner unchanged
      record = the window's flags; the window starts afresh
  otherwise: updates = -0.0

The inner transformation is ``counting_sgd``'s rule: ``updates = g * -0.5`` (in g's dtype),
``count += 1``, ``last = g`` (the gradient handed over, kept as it is).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from reference_scalers import ReferenceHeadroom  # tests/ is on sys.path under pytest

F32 = np.float32
I32_MAX = int(np.iinfo(np.int32).max)
RECENT_STEPS = 2000


def f32(x: Any) -> np.float32:
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return F32(x)


def at_least_f32(dtype: np.dtype) -> np.dtype:
    return np.dtype(dtype) if np.dtype(dtype).itemsize >= 4 else np.dtype(np.float32)


# ------------------------------------------------------------------ the check


def leaf_flag(g: np.ndarray, mode: str, limit: float) -> bool:
    """The overflow test of ``mode`` on one scaled leaf (the threshold in the leaf's dtype)."""
    with np.errstate(over="ignore", invalid="ignore"):
        lim = np.asarray(limit).astype(g.dtype)
        mag = np.abs(g)
        if mode == "ieee":
            return bool(np.any(~np.isfinite(g)))
        if mode == "saturating":
            return bool(np.any((mag >= lim) & np.isfinite(g)) or np.any(np.isinf(g)))
        return bool(np.any(mag >= lim) or np.any(np.isnan(g)))


def scale_is_bad(scale: np.float32) -> bool:
    return not (scale > 0 and np.isfinite(scale))


def amax_of(grads: list[np.ndarray], scale: np.float32, limit: float) -> np.float32:
    raw = F32(0.0)
    for g in grads:
        if g.size:
            raw = max(raw, F32(np.max(np.abs(g.astype(at_least_f32(g.dtype))))))
    return f32(raw / f32(F32(scale) * F32(limit)))


def unscale(g: np.ndarray, scale: np.float32, dtype: np.dtype) -> np.ndarray:
    """``g / scale`` as ``g * (1 / scale)`` in float32 at least, cast to ``dtype``."""
    work = at_least_f32(dtype)
    inv = f32(np.nan) if scale_is_bad(scale) else f32(F32(1.0) / F32(scale))
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        return (g.astype(work) * inv.astype(work)).astype(dtype)


# ------------------------------------------------------------------ the policies


def sat_inc(n: int) -> int:
    return n + 1 if n < I32_MAX else n


@dataclass
class LossScale:
    """A ``LossScaleState`` with NumPy scalars."""

    scale: np.float32
    growth_count: int = 0
    hysteresis_count: int = 0
    last_overflow: bool = False
    last_skipped: bool = False
    stuck: bool = False
    total_steps: int = 0
    overflow_steps: int = 0
    skipped_steps: int = 0
    recent_overflow_rate: np.float32 = field(default_factory=lambda: F32(0.0))
    range_peak: np.float32 = field(default_factory=lambda: F32(0.0))
    margin: int = 0

    def record(self, overflow: bool, skipped: bool, stuck: bool) -> None:
        """The telemetry every policy keeps (``metrics``' rule)."""
        self.last_overflow, self.last_skipped, self.stuck = overflow, skipped, stuck
        self.total_steps = sat_inc(self.total_steps)
        self.overflow_steps = sat_inc(self.overflow_steps) if overflow else self.overflow_steps
        self.skipped_steps = sat_inc(self.skipped_steps) if skipped else self.skipped_steps
        if self.total_steps <= RECENT_STEPS:
            rate = f32(F32(self.overflow_steps) / F32(max(self.total_steps, 1)))
        else:
            rate = f32(
                self.recent_overflow_rate
                + (F32(overflow) - self.recent_overflow_rate) / F32(RECENT_STEPS)
            )
        self.recent_overflow_rate = rate


def _clip(scale: np.float32, lo: float, hi: float) -> np.float32:
    """Into ``[lo, hi]``; nan goes to ``lo``."""
    if not scale >= F32(lo):
        return F32(lo)
    return min(F32(scale), F32(min(hi, float(np.finfo(np.float32).max))))


def no_scale(p, s: LossScale, overflow: bool, amax) -> None:
    s.scale = F32(1.0)
    s.record(overflow, overflow and p.skip_on_overflow, overflow)


def static_scale(p, s: LossScale, overflow: bool, amax) -> None:
    s.scale = F32(p.scale)
    s.record(overflow, overflow and p.skip_on_overflow, overflow)


def dynamic_scale(p, s: LossScale, overflow: bool, amax) -> None:
    """``DynamicScale``'s docstring rule."""
    scale = s.scale
    if overflow:
        growth = 0
        hyst = sat_inc(s.hysteresis_count)
        if p.sticky_hysteresis:
            hyst = min(hyst, p.hysteresis)
        backoff = hyst >= p.hysteresis
        new = max(f32(scale * F32(p.backoff_factor)), F32(p.min_scale)) if backoff else scale
        if backoff and not p.sticky_hysteresis:
            hyst = 0
        stuck = scale <= F32(p.min_scale) and (backoff or not p.sticky_hysteresis)
    else:
        growth = sat_inc(s.growth_count)
        hyst = 0 if p.consecutive_hysteresis else s.hysteresis_count
        new = scale
        if growth >= p.growth_interval:
            grown = f32(scale * F32(p.growth_factor))
            capped = min(grown, F32(p.max_scale))
            if p.growth_overflow == "clamp" or np.isfinite(grown):
                new = capped
            growth, hyst = 0, 0
        stuck = False
    s.scale = _clip(new, p.min_scale, p.max_scale)
    s.growth_count, s.hysteresis_count = growth, hyst
    s.record(overflow, overflow, stuck)


def tolerant_dynamic_scale(p, s: LossScale, overflow: bool, amax) -> None:
    """``TolerantDynamicScale``'s docstring rule."""
    scale = s.scale
    steps = sat_inc(s.growth_count)
    overflows = sat_inc(s.hysteresis_count) if overflow else s.hysteresis_count
    backoff = f32(F32(overflows) / F32(steps)) > F32(p.overflow_tolerance)
    if backoff:
        scale_b, steps, overflows = f32(scale * F32(p.backoff_factor)), 0, 0
    else:
        scale_b = scale
    new = scale_b
    if steps >= p.growth_interval:
        grown = min(f32(scale_b * F32(p.growth_factor)), F32(p.max_scale))
        new = grown if np.isfinite(grown) else scale_b
        steps, overflows = 0, 0
    stuck = overflow and backoff and scale <= F32(p.min_scale)
    s.scale = _clip(new, p.min_scale, p.max_scale)
    s.growth_count, s.hysteresis_count = steps, overflows
    s.record(overflow, overflow, stuck)


def headroom_scale(p, s: LossScale, overflow: bool, amax: np.float32) -> None:
    """``HeadroomScale``'s docstring rule."""
    scale = s.scale
    amax = F32(amax) if np.isfinite(amax) and amax >= 0 else F32(0.0)
    peak = s.range_peak if np.isfinite(s.range_peak) and s.range_peak >= 0 else F32(0.0)
    margin = min(max(s.margin, p.min_margin), p.max_margin)
    if overflow:
        growth = 0
        if peak == 0:
            new = f32(scale * F32(p.blind_backoff))
        else:
            if margin < p.max_margin:
                margin += 1
            else:
                peak = max(peak, f32(F32(1.0) / scale))
            new = min(f32(scale * F32(0.5)), ReferenceHeadroom.target(peak, margin))
    else:
        peak = max(amax, f32(peak * F32(p.decay)))
        growth = sat_inc(s.growth_count)
        if growth >= p.margin_interval and margin > p.min_margin:
            margin, growth = margin - 1, 0
        new = ReferenceHeadroom.target(peak, margin) if peak > 0 else f32(scale * F32(2.0))
    stuck = overflow and scale <= F32(p.min_scale)
    s.scale = _clip(new, p.min_scale, p.max_scale)
    s.growth_count, s.hysteresis_count, s.range_peak, s.margin = growth, 0, peak, margin
    s.record(overflow, overflow, stuck)


POLICY_RULES = {
    "NoScale": no_scale,
    "StaticScale": static_scale,
    "DynamicScale": dynamic_scale,
    "TolerantDynamicScale": tolerant_dynamic_scale,
    "HeadroomScale": headroom_scale,
}


def initial(policy) -> LossScale:
    name = type(policy).__name__
    scale = {"NoScale": 1.0, "StaticScale": getattr(policy, "scale", None)}.get(name)
    s = LossScale(scale=F32(policy.init_scale if scale is None else scale))
    if name == "HeadroomScale":
        s.margin = policy.min_margin
    return s


# ------------------------------------------------------------------ the engine


def landing_flag(p: np.ndarray, g: np.ndarray) -> bool:
    """Whether ``counting_sgd``'s update of ``g`` would make the float16 parameter ``p`` inf
    or nan (``False`` for other dtypes: the landing check guards float16 parameters)."""
    if p.dtype != np.float16:
        return False
    with np.errstate(invalid="ignore", over="ignore"):
        u = g * np.asarray(-0.5, g.dtype)
        landed = (p.astype(np.promote_types(p.dtype, u.dtype)) + u).astype(p.dtype)
    return not bool(np.all(np.isfinite(landed)))


@dataclass
class Inner:
    """``counting_sgd``'s state: applied steps and the last gradient it was handed."""

    count: int
    last: list[np.ndarray]


class Reference:
    """One front-end's run: ``step(scaled_grads)`` per call, the state after it in fields.

    ``params`` and gradients are lists of leaves in ``tree_leaves`` order. ``groups`` (for
    ``multi_optimizer``) partitions the leaf indices; each group is skipped only for its own
    overflow (and only when the policy skips).
    """

    def __init__(
        self,
        policy,
        params: list[np.ndarray],
        *,
        mode: str,
        every_k: int = 1,
        limit: float = 65504.0,
        groups: list[list[int]] | None = None,
    ) -> None:
        self.policy, self.rule = policy, POLICY_RULES[type(policy).__name__]
        self.mode, self.k, self.limit = mode, every_k, limit
        self.params = [np.array(p) for p in params]
        self.groups = groups or [list(range(len(params)))]
        self.inner = [Inner(0, [np.zeros(p.shape, p.dtype) for p in params]) for _ in self.groups]
        self.ls = initial(policy)
        self.record = np.zeros(len(params), bool)
        self.mini_step = 0
        self._window_reset()
        self.applied_steps = 0  # what a train state's step counts

    def _window_reset(self) -> None:
        n = len(self.params)
        self.window_overflow = False
        self.window_record = np.zeros(n, bool)
        self.window_range = F32(0.0)
        self.acc = [np.zeros(p.shape, at_least_f32(p.dtype)) for p in self.params]

    def step(self, grads: list[np.ndarray]) -> list[np.ndarray]:
        """One call: returns the updates (and applies them to ``self.params``)."""
        scale = self.ls.scale
        flags = np.array([leaf_flag(g, self.mode, self.limit) for g in grads])
        found = bool(flags.any()) or scale_is_bad(scale)
        measures = type(self.policy).__name__ == "HeadroomScale"
        amax = amax_of(grads, scale, self.limit) if measures else None
        unscaled = [unscale(g, scale, p.dtype) for g, p in zip(grads, self.params, strict=True)]
        updates = [np.full(p.shape, -0.0, p.dtype) for p in self.params]

        self.window_overflow |= found
        self.window_record |= flags
        if measures:
            self.window_range = max(self.window_range, amax)
        if not found:
            self.acc = [a + u.astype(a.dtype) for a, u in zip(self.acc, unscaled, strict=True)]
        if self.mini_step < self.k - 1:
            self.mini_step += 1
            return self._apply(updates)

        if self.k == 1:
            mean = unscaled
        else:
            mean = [
                (a * f32(1.0 / self.k).astype(a.dtype)).astype(p.dtype)
                for a, p in zip(self.acc, self.params, strict=True)
            ]
        # Where the update would land (metrics' "unlanded"): a float16 parameter it would make
        # inf or nan stops the step, though the gradients did not overflow.
        landing = np.array([landing_flag(p, m) for p, m in zip(self.params, mean, strict=True)])
        landing &= not scale_is_bad(scale)  # then the overflow is the scale's, no leaf's
        before = copy.deepcopy(self.ls)
        self.rule(self.policy, self.ls, self.window_overflow, self.window_range)
        if landing.any() and not self.ls.last_skipped:  # the scale stays: no scale fixes it
            self.ls = before
            self.ls.record(self.window_overflow, True, True)
        if not self.window_overflow:
            self.window_record |= landing
        skipped = self.ls.last_skipped
        for inner, members in zip(self.inner, self.groups, strict=True):
            blocked = self.window_record[members].any() or landing[members].any()
            mine = bool(blocked) or scale_is_bad(scale)
            if skipped and mine:  # a group is skipped for its own overflow
                continue
            inner.count = sat_inc(inner.count)
            for i in members:
                inner.last[i] = mean[i]
                with np.errstate(invalid="ignore", over="ignore"):
                    updates[i] = mean[i] * np.asarray(-0.5, mean[i].dtype)
        if not skipped:
            self.applied_steps += 1
        self.record = self.window_record.copy()
        self.mini_step = 0
        self._window_reset()
        return self._apply(updates)

    def _apply(self, updates: list[np.ndarray]) -> list[np.ndarray]:
        with np.errstate(invalid="ignore", over="ignore"):
            self.params = [
                (p + u.astype(p.dtype)).astype(p.dtype)
                for p, u in zip(self.params, updates, strict=True)
            ]
        return updates

    def metrics(self) -> dict[str, Any]:
        """``lsj.metrics``' keys, from the reference state."""
        s = self.ls
        rate = f32(F32(s.overflow_steps) / F32(s.total_steps)) if s.total_steps else F32(0.0)
        first = int(np.argmax(self.record)) if self.record.any() else -1
        return {
            "loss_scale": s.scale,
            "overflow": s.last_overflow,
            "skipped": s.last_skipped,
            "stuck": s.stuck,
            "unlanded": s.last_skipped and not s.last_overflow,
            "total_steps": s.total_steps,
            "overflow_steps": s.overflow_steps,
            "skipped_steps": s.skipped_steps,
            "overflow_rate": rate,
            "recent_overflow_rate": s.recent_overflow_rate,
            "overflow_leaves": int(self.record.sum()),
            "first_overflow_leaf": first,
        }
