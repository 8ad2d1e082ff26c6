"""Loss-scale state and the policies that adjust it.

``LossScaleState`` is a pytree of fixed-dtype arrays and nothing else. A
policy holds static, validated hyperparameters and two pure functions:
``init() -> LossScaleState`` and ``adjust(state, overflow) -> LossScaleState``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import chex
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

_F32_MAX = float(np.finfo(np.float32).max)
_I32_MAX = int(np.iinfo(np.int32).max)
_GROWTH_OVERFLOW: tuple[str, ...] = ("refuse", "clamp")

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

    from typing_extensions import Self

    class _ChexDataclass(Mapping[str, jax.Array]):
        """What ``chex.dataclass`` adds to a class at run time, spelled out for type checkers.

        It makes the class a ``collections.abc.Mapping`` of its fields (so a state is an
        ``optax.OptState``) with a ``replace`` method.
        """

        def replace(self, **changes: Any) -> Self: ...
        def __getitem__(self, key: str) -> jax.Array: ...
        def __iter__(self) -> Iterator[str]: ...
        def __len__(self) -> int: ...

else:
    _ChexDataclass = object


@chex.dataclass
class LossScaleState(_ChexDataclass):
    """The loss scale and its counters; a pytree of fixed-dtype arrays.

    Attributes:
      scale: float32 scalar, the factor the loss is multiplied by.
      growth_count: int32, good steps since the scale last changed or an
        overflow was seen.
      hysteresis_count: int32, overflows counted toward the next backoff.
      last_overflow: bool, whether the last step saw an overflow.
      last_skipped: bool, whether the last step's update was skipped.
      stuck: bool, whether the last step overflowed while the policy could not
        lower the scale any further (``DynamicScale`` at ``min_scale``; every
        overflow of ``StaticScale``/``NoScale``). Training that stays stuck
        skips every step; see ``metrics``.
      total_steps: int32, steps seen (saturating increment).
      overflow_steps: int32, steps that saw an overflow (saturating).
      skipped_steps: int32, steps whose update was skipped (saturating).
      recent_overflow_rate: float32, the fraction of recent steps that saw an
        overflow, in [0, 1]: ``overflow_steps / total_steps`` for the first
        2000 steps, then an exponential moving average with weight 1/2000
        (see ``metrics``).
      range_peak: float32, ``HeadroomScale``'s held peak of the gradients'
        range (the largest magnitude of the scaled gradients divided by
        ``scale`` and by ``finfo(compute_dtype).max``); 0 when nothing was
        measured. Other policies keep 0.
      margin: int32, the octaves ``HeadroomScale`` keeps between the scale and
        the headroom the gradients show. Other policies keep 0.

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale_jax as lsj
      >>> state = lsj.DynamicScale(init_scale=2.0**15).init()
      >>> float(state.scale), state.scale.dtype, state.growth_count.dtype
      (32768.0, dtype('float32'), dtype('int32'))
      >>> float(state.replace(scale=jnp.float32(2.0**10)).scale)   # a new state, same dtypes
      1024.0
    """

    scale: jax.Array
    growth_count: jax.Array
    hysteresis_count: jax.Array
    last_overflow: jax.Array
    last_skipped: jax.Array
    stuck: jax.Array
    total_steps: jax.Array
    overflow_steps: jax.Array
    skipped_steps: jax.Array
    recent_overflow_rate: jax.Array
    range_peak: jax.Array
    margin: jax.Array


# The horizon of ``recent_overflow_rate``: the mean over all steps for the first
# RECENT_STEPS steps, then an exponential moving average with weight 1/RECENT_STEPS.
# DynamicScale's default growth_interval: a healthy dynamic run's probing overflow
# (one per growth_interval steps) moves the rate by 0.05%, half the strictest guideline.
RECENT_STEPS = 2000


def _zeros_i32() -> jax.Array:
    return jnp.zeros([], jnp.int32)


def initial_state(scale: ArrayLike) -> LossScaleState:
    """A fresh ``LossScaleState`` at ``scale`` with every counter at zero."""
    return LossScaleState(
        scale=jnp.asarray(scale, jnp.float32),
        growth_count=_zeros_i32(),
        hysteresis_count=_zeros_i32(),
        last_overflow=jnp.zeros([], jnp.bool_),
        last_skipped=jnp.zeros([], jnp.bool_),
        stuck=jnp.zeros([], jnp.bool_),
        total_steps=_zeros_i32(),
        overflow_steps=_zeros_i32(),
        skipped_steps=_zeros_i32(),
        recent_overflow_rate=jnp.zeros([], jnp.float32),
        range_peak=jnp.zeros([], jnp.float32),
        margin=_zeros_i32(),
    )


def _safe_increment(count: jax.Array) -> jax.Array:
    """``count + 1`` for int32 counters, saturating at the largest int32."""
    return jnp.where(count < _I32_MAX, count + 1, count).astype(jnp.int32)


def _increment_if(flag: jax.Array, count: jax.Array) -> jax.Array:
    return jnp.where(flag, _safe_increment(count), count)


def _recent_rate(
    rate: jax.Array, overflow: jax.Array, total_steps: jax.Array, overflow_steps: jax.Array
) -> jax.Array:
    """The recent overflow rate after a step; the counters include that step.

    Rule (float32)::

      if total_steps <= RECENT_STEPS:
          rate = overflow_steps / total_steps        # the mean so far: overflow_rate
      else:
          rate = rate + (overflow - rate) / RECENT_STEPS

    An exponential moving average with weight ``1 / RECENT_STEPS``, started
    from the exact mean of the first ``RECENT_STEPS`` steps (no bias toward 0
    in the first steps, no dependence on an initial value).
    """
    f32 = jnp.float32
    mean = overflow_steps.astype(f32) / jnp.maximum(total_steps, 1).astype(f32)
    ema = rate.astype(f32) + (overflow.astype(f32) - rate.astype(f32)) / f32(RECENT_STEPS)
    return jnp.where(total_steps <= RECENT_STEPS, mean, ema)


def _record(
    state: LossScaleState,
    overflow: jax.Array,
    skipped: jax.Array,
    stuck: jax.Array,
    **changes: jax.Array,
) -> LossScaleState:
    """The telemetry every policy keeps, plus the policy's own field changes."""
    total = _safe_increment(state.total_steps)
    overflows = _increment_if(overflow, state.overflow_steps)
    return state.replace(
        last_overflow=overflow,
        last_skipped=skipped,
        stuck=stuck,
        total_steps=total,
        overflow_steps=overflows,
        skipped_steps=_increment_if(skipped, state.skipped_steps),
        recent_overflow_rate=_recent_rate(state.recent_overflow_rate, overflow, total, overflows),
        **changes,
    )


def _as_overflow(overflow: ArrayLike) -> jax.Array:
    flag = jnp.asarray(overflow)
    if flag.shape != ():
        raise ValueError(f"overflow must be a scalar, got shape {flag.shape}.")
    return flag.astype(jnp.bool_)


# --------------------------------------------------------------------------
# Validation helpers: every bad hyperparameter raises at construction time.


def _concrete(name: str, value: Any) -> Any:
    """``value`` as a Python ``int``/``float``/``bool`` if it is a concrete 0-d scalar.

    Python numbers, NumPy scalars and 0-d NumPy or JAX arrays are accepted alike
    (``np.float64(1024)``, ``jnp.float32(1024)``); a traced value is refused
    (hyperparameters are static: build policies outside ``jit``).
    """
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} must be a concrete number, got a traced value ({value.aval}): "
            "hyperparameters are static Python values; build the policy outside "
            "jax.jit/grad/vmap."
        )
    if isinstance(value, bool | int | float | np.number | np.bool_):
        return value.item() if isinstance(value, np.generic) else value
    if isinstance(value, np.ndarray | jax.Array) and np.shape(value) == ():
        return np.asarray(value).item()
    return value


def _check_real(name: str, value: Any) -> float:
    v = _concrete(name, value)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__}).")
    return float(v)


def _check_positive_finite(name: str, value: Any) -> float:
    v = _check_real(name, value)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    if v > _F32_MAX:
        raise ValueError(f"{name} must fit in float32 (<= {_F32_MAX:.4g}), got {value!r}.")
    if np.float32(v) == 0.0:
        raise ValueError(f"{name} underflows to 0 in float32, got {value!r}.")
    return v


def _check_int(name: str, value: Any, minimum: int) -> int:
    v = _concrete(name, value)
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
    if not minimum <= v <= _I32_MAX:
        raise ValueError(f"{name} must be an int in [{minimum}, {_I32_MAX}], got {value!r}.")
    return v


def _check_bool(name: str, value: Any) -> bool:
    v = _concrete(name, value)
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__}).")
    return v


def _store(policy: LossScalePolicy, **values: Any) -> None:
    """Sets validated hyperparameters on a frozen policy as plain Python values.

    A policy is hashable and static: a NumPy or JAX scalar given by the user is
    kept as the Python number it stands for.
    """
    for name, value in values.items():
        object.__setattr__(policy, name, value)


def _check_growth_rule(
    growth_factor: Any, backoff_factor: Any, growth_interval: Any
) -> tuple[float, float, int]:
    """The factors and interval every dynamic policy shares, as Python numbers."""
    growth = _check_real("growth_factor", growth_factor)
    if not (math.isfinite(growth) and growth > 1.0):
        raise ValueError(f"growth_factor must be a finite number > 1, got {growth_factor!r}.")
    backoff = _check_real("backoff_factor", backoff_factor)
    if not 0.0 < backoff < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}.")
    return growth, backoff, _check_int("growth_interval", growth_interval, 1)


def _clamp(scale: jax.Array, min_scale: float, max_scale: float) -> jax.Array:
    """``scale`` moved into ``[min_scale, max_scale]`` (float32); nan goes to ``min_scale``.

    The identity on every finite scale already in the range, so a state the
    policy produced itself steps exactly as before.
    """
    lo = jnp.asarray(min_scale, jnp.float32)
    hi = jnp.asarray(min(max_scale, _F32_MAX), jnp.float32)
    return jnp.where(scale >= lo, jnp.minimum(scale, hi), lo)


def _with_scale(state: LossScaleState, scale: jax.Array) -> LossScaleState:
    """``state`` at ``scale``; the counters since the last change restart if it moved.

    Every other field (telemetry, flags) is kept.
    """
    scale = jnp.asarray(scale, jnp.float32)
    moved = jnp.logical_not(scale == state.scale)  # nan in the old state counts as moved
    zero = jnp.zeros([], jnp.int32)
    return state.replace(
        scale=scale,
        growth_count=jnp.where(moved, zero, state.growth_count),
        hysteresis_count=jnp.where(moved, zero, state.hysteresis_count),
    )


# --------------------------------------------------------------------------
# Policies.


class LossScalePolicy:
    """Base class of loss-scale policies.

    A policy is immutable and hashable; its hyperparameters are static Python
    values. Subclasses implement ``init``, ``adjust`` and ``conform``;
    ``adjust`` obeys the policy whatever state it is given (a state restored
    from a checkpoint, or made by another policy): its result is always a
    state this policy can hold.

    Examples:
      >>> import lossscale_jax as lsj
      >>> policy = lsj.DynamicScale(init_scale=8.0, growth_interval=2)
      >>> isinstance(policy, lsj.LossScalePolicy)
      True
      >>> state = policy.init()
      >>> state = policy.adjust(state, True)            # an overflow: back off, skip
      >>> float(state.scale), bool(state.last_skipped)
      (4.0, True)
      >>> state = policy.adjust(policy.adjust(state, False), False)  # two good steps: grow
      >>> float(state.scale), int(state.total_steps)
      (8.0, 3)
      >>> capped = lsj.DynamicScale(init_scale=4.0, max_scale=4.0)
      >>> float(capped.conform(state).scale)            # into the other policy's bounds
      4.0
    """

    #: Whether ``adjust`` takes the gradients' range (``amax=``) from the overflow
    #: check; the transformations measure it, in the same pass, only then.
    measures_range: bool = False

    def init(self) -> LossScaleState:
        """A fresh state at the policy's starting scale, every counter at zero."""
        raise NotImplementedError

    def adjust(self, state: LossScaleState, overflow: ArrayLike) -> LossScaleState:
        """The state after one step whose (reduced) overflow flag is ``overflow``."""
        raise NotImplementedError

    def conform(self, state: LossScaleState) -> LossScaleState:
        """``state`` moved to where this policy keeps it, without taking a step.

        Rule::

          scale = the nearest scale this policy can hold (see each policy)
          if scale moved: growth_count = hysteresis_count = 0
          every other field (telemetry, flags) is kept

        ``lossscale_jax.switch_policy`` applies it to an optimizer state. A
        state the policy produced itself comes back unchanged.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not implement conform(state); a LossScalePolicy "
            "subclass needs it for switch_policy and the checkpoint checks."
        )


@dataclasses.dataclass(frozen=True)
class NoScale(LossScalePolicy):
    """No loss scaling (bfloat16 or float32 training): the scale stays 1.

    Rule::

      scale = 1                       # also for a state made by another policy
      skipped = overflow and skip_on_overflow

    Args:
      skip_on_overflow: skip the update when the gradients overflow. Off by
        default: ``NoScale`` is the identity unless asked.

    Examples:
      >>> import lossscale_jax as lsj
      >>> float(lsj.NoScale().init().scale)
      1.0
    """

    skip_on_overflow: bool = False

    def __post_init__(self) -> None:
        _store(self, skip_on_overflow=_check_bool("skip_on_overflow", self.skip_on_overflow))

    def init(self) -> LossScaleState:
        return initial_state(1.0)

    def adjust(self, state: LossScaleState, overflow: ArrayLike) -> LossScaleState:
        overflow = _as_overflow(overflow)
        skipped = jnp.logical_and(overflow, self.skip_on_overflow)
        return _record(state, overflow, skipped, stuck=overflow, scale=jnp.ones([], jnp.float32))

    def conform(self, state: LossScaleState) -> LossScaleState:
        """``state`` at scale 1 (see ``LossScalePolicy.conform``)."""
        return _with_scale(state, jnp.ones([], jnp.float32))


@dataclasses.dataclass(frozen=True)
class StaticScale(LossScalePolicy):
    """A fixed loss scale.

    Rule::

      scale = the policy's scale      # also for a state made by another policy
      skipped = overflow and skip_on_overflow

    The scale lives in the state (a float32 array), which ``scale_loss`` and
    the unscale read. A state made with another scale (restored from a
    checkpoint, or by another policy) still unscales its first step with the
    scale its gradients were computed with; ``adjust`` then writes the
    policy's own. ``lossscale_jax.switch_policy`` moves it before that step.

    Args:
      scale: the loss scale, a finite float > 0.
      skip_on_overflow: skip the update when the gradients overflow (default).

    Examples:
      >>> import lossscale_jax as lsj
      >>> float(lsj.StaticScale(128.0).init().scale)
      128.0
    """

    scale: float
    skip_on_overflow: bool = True

    def __post_init__(self) -> None:
        _store(
            self,
            scale=_check_positive_finite("scale", self.scale),
            skip_on_overflow=_check_bool("skip_on_overflow", self.skip_on_overflow),
        )

    def init(self) -> LossScaleState:
        return initial_state(self.scale)

    def adjust(self, state: LossScaleState, overflow: ArrayLike) -> LossScaleState:
        overflow = _as_overflow(overflow)
        skipped = jnp.logical_and(overflow, self.skip_on_overflow)
        own = jnp.asarray(self.scale, jnp.float32)
        return _record(state, overflow, skipped, stuck=overflow, scale=own)

    def conform(self, state: LossScaleState) -> LossScaleState:
        """``state`` at the policy's scale (see ``LossScalePolicy.conform``)."""
        return _with_scale(state, jnp.asarray(self.scale, jnp.float32))


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
        init_scale = _check_positive_finite("init_scale", self.init_scale)
        growth, backoff, interval = _check_growth_rule(
            self.growth_factor, self.backoff_factor, self.growth_interval
        )
        hysteresis = _check_int("hysteresis", self.hysteresis, 1)
        consecutive = _check_bool("consecutive_hysteresis", self.consecutive_hysteresis)
        min_scale = _check_positive_finite("min_scale", self.min_scale)
        max_scale = _check_real("max_scale", self.max_scale)
        if math.isnan(max_scale) or max_scale <= 0.0:
            raise ValueError(f"max_scale must be > 0 (or inf), got {self.max_scale!r}.")
        if min_scale > max_scale:
            raise ValueError(
                f"min_scale ({self.min_scale!r}) must not exceed max_scale ({self.max_scale!r})."
            )
        if not min_scale <= init_scale <= max_scale:
            raise ValueError(
                f"init_scale must be in [min_scale, max_scale] = "
                f"[{self.min_scale!r}, {self.max_scale!r}], got {self.init_scale!r}."
            )
        sticky = _check_bool("sticky_hysteresis", self.sticky_hysteresis)
        if self.growth_overflow not in _GROWTH_OVERFLOW:
            raise ValueError(
                f"growth_overflow must be one of {_GROWTH_OVERFLOW}, got {self.growth_overflow!r}."
            )
        if self.growth_overflow == "clamp" and not math.isfinite(max_scale):
            raise ValueError(
                f"growth_overflow='clamp' needs a finite max_scale, got {self.max_scale!r}."
            )
        _store(
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

    def adjust(self, state: LossScaleState, overflow: ArrayLike) -> LossScaleState:
        overflow = _as_overflow(overflow)
        f32 = jnp.float32
        scale = state.scale
        zero = jnp.zeros([], jnp.int32)

        # Overflow branch.
        hyst_bad = _safe_increment(state.hysteresis_count)
        if self.sticky_hysteresis:
            hyst_bad = jnp.minimum(hyst_bad, jnp.asarray(self.hysteresis, jnp.int32))
        backoff = hyst_bad >= self.hysteresis
        backed_off = jnp.maximum(
            scale * jnp.asarray(self.backoff_factor, f32), jnp.asarray(self.min_scale, f32)
        )
        bad_scale = jnp.where(backoff, backed_off, scale)
        bad_hyst = hyst_bad if self.sticky_hysteresis else jnp.where(backoff, zero, hyst_bad)

        # Good branch.
        growth_good = _safe_increment(state.growth_count)
        grow = growth_good >= self.growth_interval
        grown = scale * jnp.asarray(self.growth_factor, f32)
        capped = jnp.minimum(grown, jnp.asarray(self.max_scale, f32))
        if self.growth_overflow == "refuse":
            capped = jnp.where(jnp.isfinite(grown), capped, scale)
        good_scale = jnp.where(grow, capped, scale)
        good_growth = jnp.where(grow, zero, growth_good)
        keep_hyst = jnp.logical_and(jnp.logical_not(grow), not self.consecutive_hysteresis)
        good_hyst = jnp.where(keep_hyst, state.hysteresis_count, zero)

        at_floor = scale <= jnp.asarray(self.min_scale, f32)
        if self.sticky_hysteresis:
            at_floor = jnp.logical_and(at_floor, backoff)
        new_scale = jnp.where(overflow, bad_scale, good_scale)
        return _record(
            state,
            overflow,
            overflow,
            stuck=jnp.logical_and(overflow, at_floor),
            scale=_clamp(new_scale, self.min_scale, self.max_scale),
            growth_count=jnp.where(overflow, zero, good_growth),
            hysteresis_count=jnp.where(overflow, bad_hyst, good_hyst),
        )

    def conform(self, state: LossScaleState) -> LossScaleState:
        """``state`` with its scale clipped into ``[min_scale, max_scale]`` (nan: ``min_scale``).

        See ``LossScalePolicy.conform``: a scale inside the range is kept, so a
        run continues from where it is rather than from ``init_scale``.
        """
        return _with_scale(state, _clamp(state.scale, self.min_scale, self.max_scale))


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
        init_scale = _check_positive_finite("init_scale", self.init_scale)
        growth, backoff, interval = _check_growth_rule(
            self.growth_factor, self.backoff_factor, self.growth_interval
        )
        tolerance = _check_real("overflow_tolerance", self.overflow_tolerance)
        if not 0.0 <= tolerance <= 1.0:
            raise ValueError(
                f"overflow_tolerance must be in [0, 1], got {self.overflow_tolerance!r}."
            )
        min_scale = _check_positive_finite("min_scale", self.min_scale)
        max_scale = _check_real("max_scale", self.max_scale)
        if math.isnan(max_scale) or max_scale < min_scale:
            raise ValueError(
                f"max_scale must be >= min_scale ({self.min_scale!r}) (or inf), "
                f"got {self.max_scale!r}."
            )
        _store(
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

    def adjust(self, state: LossScaleState, overflow: ArrayLike) -> LossScaleState:
        overflow = _as_overflow(overflow)
        f32 = jnp.float32
        zero = jnp.zeros([], jnp.int32)
        scale = state.scale
        lo = jnp.asarray(self.min_scale, f32)
        hi = jnp.asarray(self.max_scale, f32)

        steps = _safe_increment(state.growth_count)
        overflows = _increment_if(overflow, state.hysteresis_count)
        ratio = overflows.astype(f32) / steps.astype(f32)
        backoff = ratio > jnp.asarray(self.overflow_tolerance, f32)
        scale_b = jnp.where(backoff, scale * jnp.asarray(self.backoff_factor, f32), scale)
        steps = jnp.where(backoff, zero, steps)
        overflows = jnp.where(backoff, zero, overflows)

        grow = steps >= self.growth_interval
        grown = jnp.minimum(scale_b * jnp.asarray(self.growth_factor, f32), hi)
        grown = jnp.where(jnp.isfinite(grown), grown, scale_b)
        scale_g = jnp.where(grow, grown, scale_b)
        steps = jnp.where(grow, zero, steps)
        overflows = jnp.where(grow, zero, overflows)

        new_scale = _clamp(scale_g, self.min_scale, self.max_scale)
        stuck = jnp.logical_and(overflow, jnp.logical_and(backoff, scale <= lo))
        return _record(
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
        clipped = _clamp(state.scale, self.min_scale, self.max_scale)
        return _with_scale(state, jnp.where(fresh, state.scale, clipped))


def _pow2_target(peak: jax.Array, margin: jax.Array) -> jax.Array:
    """``2 ** (floor(log2(1 / peak)) - margin)`` in float32, exactly (frexp, ldexp).

    ``inf`` when ``1 / peak`` is (``peak`` 0 or subnormal): the clip to
    ``max_scale`` that follows turns it into the cap.
    """
    inv = jnp.float32(1.0) / peak
    _, exp = jnp.frexp(inv)
    e = exp.astype(jnp.int32) - 1 - margin
    out = jnp.ldexp(jnp.float32(1.0), jnp.minimum(e, 128))
    return jnp.where(jnp.isfinite(inv), out, jnp.float32(jnp.inf))


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
    skip a step every ``growth_interval`` as ``DynamicScale`` does. Where the
    parameter gradients say nothing about the ceiling (a float16 loss, whose
    cotangent is the scale itself, overflows at 2**16 whatever the gradients),
    it probes like ``DynamicScale`` with ``growth_interval=margin_interval``.

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

    measures_range = True

    def __post_init__(self) -> None:
        init_scale = _check_positive_finite("init_scale", self.init_scale)
        min_margin = _check_int("min_margin", self.min_margin, 0)
        max_margin = _check_int("max_margin", self.max_margin, 0)
        if max_margin < min_margin:
            raise ValueError(
                f"max_margin ({self.max_margin!r}) must be >= min_margin ({self.min_margin!r})."
            )
        if max_margin > 64:
            raise ValueError(
                f"max_margin must be an int in [min_margin, 64] (octaves), got {self.max_margin!r}."
            )
        interval = _check_int("margin_interval", self.margin_interval, 1)
        window = _check_int("window", self.window, 1)
        backoff = _check_real("blind_backoff", self.blind_backoff)
        if not 0.0 < backoff < 1.0:
            raise ValueError(f"blind_backoff must be in (0, 1), got {self.blind_backoff!r}.")
        min_scale = _check_positive_finite("min_scale", self.min_scale)
        max_scale = _check_real("max_scale", self.max_scale)
        if math.isnan(max_scale) or max_scale < min_scale:
            raise ValueError(
                f"max_scale must be >= min_scale ({self.min_scale!r}) (or inf), "
                f"got {self.max_scale!r}."
            )
        if not min_scale <= init_scale <= max_scale:
            raise ValueError(
                f"init_scale must be in [min_scale, max_scale] = "
                f"[{self.min_scale!r}, {self.max_scale!r}], got {self.init_scale!r}."
            )
        _store(
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
        overflow = _as_overflow(overflow)
        amax = jnp.asarray(amax)
        if amax.shape != ():
            raise ValueError(f"amax must be a scalar, got shape {amax.shape}.")
        f32, i32 = jnp.float32, jnp.int32
        amax = amax.astype(f32)
        amax = jnp.where(jnp.logical_and(jnp.isfinite(amax), amax >= 0), amax, f32(0.0))
        scale = state.scale
        peak = state.range_peak.astype(f32)
        peak = jnp.where(jnp.logical_and(jnp.isfinite(peak), peak >= 0), peak, f32(0.0))
        margin = jnp.clip(state.margin, self.min_margin, self.max_margin).astype(i32)
        zero = jnp.zeros([], i32)

        # Overflow branch.
        blind = peak == 0
        spent = margin >= self.max_margin
        widened = jnp.minimum(margin + 1, self.max_margin).astype(i32)
        margin_bad = jnp.where(blind, margin, widened)
        remember = jnp.logical_and(jnp.logical_not(blind), spent)
        peak_bad = jnp.where(remember, jnp.maximum(peak, f32(1.0) / scale), peak)
        informed = jnp.minimum(scale * f32(0.5), _pow2_target(peak_bad, margin_bad))
        scale_bad = jnp.where(blind, scale * f32(self.blind_backoff), informed)

        # Good branch.
        peak_good = jnp.maximum(amax, peak * f32(self.decay))
        count = _safe_increment(state.growth_count)
        give_back = jnp.logical_and(count >= self.margin_interval, margin > self.min_margin)
        margin_good = jnp.where(give_back, margin - 1, margin).astype(i32)
        count = jnp.where(give_back, zero, count)
        scale_good = jnp.where(
            peak_good > 0, _pow2_target(peak_good, margin_good), scale * f32(2.0)
        )

        new_scale = jnp.where(overflow, scale_bad, scale_good)
        at_floor = scale <= f32(self.min_scale)
        return _record(
            state,
            overflow,
            overflow,
            stuck=jnp.logical_and(overflow, at_floor),
            scale=_clamp(new_scale, self.min_scale, self.max_scale),
            growth_count=jnp.where(overflow, zero, count),
            hysteresis_count=zero,
            range_peak=jnp.where(overflow, peak_bad, peak_good),
            margin=jnp.where(overflow, margin_bad, margin_good),
        )

    def conform(self, state: LossScaleState) -> LossScaleState:
        """``state`` with its scale clipped into ``[min_scale, max_scale]`` (nan: ``min_scale``)
        and its margin into ``[min_margin, max_margin]``.

        See ``LossScalePolicy.conform``; the held peak is kept (one that is not
        finite or < 0 becomes 0, nothing measured).
        """
        new = _with_scale(state, _clamp(state.scale, self.min_scale, self.max_scale))
        peak = state.range_peak.astype(jnp.float32)
        ok = jnp.logical_and(jnp.isfinite(peak), peak >= 0)
        return new.replace(
            margin=jnp.clip(state.margin, self.min_margin, self.max_margin).astype(jnp.int32),
            range_peak=jnp.where(ok, peak, jnp.float32(0.0)),
        )
