"""``LossScaleState``: the loss scale and its counters, and the telemetry every policy keeps.

A pytree of fixed-dtype arrays and nothing else (scale float32, counters int32, flags
bool). The policies (``lossscale_jax.policies``) write it; the engine reads its scale.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from lossscale_jax.engine._division import divide_by_count
from lossscale_jax.engine._ops import where

F32_MAX = float(np.finfo(np.float32).max)
I32_MAX = int(np.iinfo(np.int32).max)

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping
    from typing import Self

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
      last_overflow: bool, whether the last step's gradients overflowed.
      last_skipped: bool, whether the last step's update was skipped (for an
        overflow, or, with float16 parameters, because the update would have
        written inf or nan into one of them: then ``last_overflow`` is False).
      stuck: bool, whether the last step was skipped for a reason no scale
        fixes: it overflowed while the policy could not lower the scale any
        further (``DynamicScale`` at ``min_scale``; every overflow of
        ``StaticScale``/``NoScale``), or its update could not land in float16
        parameters. Training that stays stuck skips every step; see ``metrics``.
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
      policy_state: the state a policy keeps beside these fields, a pytree of
        fixed-dtype arrays its ``init`` makes (fairseq's and metaseq's scalers
        with ``tolerance > 0`` keep their two counters here); ``None``, for a
        policy that needs none (all the others). It is checkpointed and
        restored with the rest; a policy reads a ``policy_state`` of another
        structure (a state made by another policy) as a fresh one (see
        ``keep_policy_state``).

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
    policy_state: Any = None


# The horizon of ``recent_overflow_rate``: the mean over all steps for the first
# RECENT_STEPS steps, then an exponential moving average with weight 1/RECENT_STEPS.
# DynamicScale's default growth_interval: a healthy dynamic run's probing overflow
# (one per growth_interval steps) moves the rate by 0.05%, half the strictest guideline.
RECENT_STEPS = 2000


def zeros_i32() -> jax.Array:
    return jnp.zeros([], jnp.int32)


def initial_state(scale: ArrayLike, policy_state: Any = None) -> LossScaleState:
    """A fresh ``LossScaleState`` at ``scale`` with every counter at zero."""
    return LossScaleState(
        scale=jnp.asarray(scale, jnp.float32),
        growth_count=zeros_i32(),
        hysteresis_count=zeros_i32(),
        last_overflow=jnp.zeros([], jnp.bool_),
        last_skipped=jnp.zeros([], jnp.bool_),
        stuck=jnp.zeros([], jnp.bool_),
        total_steps=zeros_i32(),
        overflow_steps=zeros_i32(),
        skipped_steps=zeros_i32(),
        recent_overflow_rate=jnp.zeros([], jnp.float32),
        range_peak=jnp.zeros([], jnp.float32),
        margin=zeros_i32(),
        policy_state=policy_state,
    )


def keep_policy_state(state: LossScaleState, fresh: Any) -> LossScaleState:
    """``state`` with a ``policy_state`` of ``fresh``'s structure, shapes and dtypes.

    Rule::

      if state.policy_state has fresh's tree structure, and each leaf fresh's dtype and
      the shape leading_axes + fresh's shape:   state, unchanged
      else:  state.replace(policy_state=fresh, each leaf broadcast to leading_axes)

    ``leading_axes`` is the shape of ``state.scale`` (one value per device under
    ``jax.pmap``). A policy calls it on the state it is given, so that a state made by
    another policy (``None`` there, or another policy's counters) starts this policy's
    own state fresh, as ``init`` would.

    Args:
      state: a ``LossScaleState``, made by any policy.
      fresh: the policy's own state as its ``init`` makes it (``None``: it keeps none).

    Returns:
      ``state`` itself, or ``state`` with ``policy_state`` replaced.

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale_jax as lsj
      >>> fresh = {"overflows": jnp.zeros([], jnp.int32)}
      >>> state = lsj.DynamicScale().init()            # policy_state is None
      >>> int(lsj.keep_policy_state(state, fresh).policy_state["overflows"])
      0
      >>> mine = state.replace(policy_state={"overflows": jnp.asarray(3, jnp.int32)})
      >>> lsj.keep_policy_state(mine, fresh) is mine
      True
    """
    lead = tuple(jnp.shape(state.scale))
    have, want = state.policy_state, fresh
    have_leaves, have_def = jax.tree_util.tree_flatten(have)
    want_leaves, want_def = jax.tree_util.tree_flatten(want)
    if have_def == want_def and all(
        jnp.shape(h) == lead + tuple(jnp.shape(w)) and jnp.result_type(h) == jnp.result_type(w)
        for h, w in zip(have_leaves, want_leaves, strict=True)
    ):
        return state
    return state.replace(
        policy_state=jax.tree_util.tree_map(
            lambda w: jnp.broadcast_to(jnp.asarray(w), lead + tuple(jnp.shape(w))), want
        )
    )


def is_loss_scale_state(x: Any) -> bool:
    return isinstance(x, LossScaleState)


def safe_increment(count: jax.Array) -> jax.Array:
    """``count + 1`` for int32 counters, saturating at the largest int32."""
    return where(count < I32_MAX, count + 1, count).astype(jnp.int32)


def increment_if(flag: jax.Array, count: jax.Array) -> jax.Array:
    return where(flag, safe_increment(count), count)


def recent_rate(
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
    # Each division rounded once, as IEEE (and the reference model) says, on every backend.
    counted = jnp.clip(total_steps, 1, RECENT_STEPS)  # the mean is read up to RECENT_STEPS
    rate = rate.astype(f32)
    steps, delta = overflow_steps.astype(f32), overflow.astype(f32) - rate
    in_mean = total_steps <= RECENT_STEPS
    # Each backend's quotient as before (the EMA's divisor a constant, which XLA may turn
    # into a product by its reciprocal), then the one the step keeps corrected: one
    # correction (some 140 scalar operations, much of the step's compile time on XLA:CPU)
    # instead of two, and the same bits, the correction being elementwise.
    q = where(in_mean, steps / counted.astype(f32), delta / f32(RECENT_STEPS))
    a = where(in_mean, steps, delta)
    n = where(in_mean, counted, jnp.int32(RECENT_STEPS))
    kept = divide_by_count(a, n, q)
    return where(in_mean, kept, rate + kept)


def record_step(
    state: LossScaleState,
    overflow: jax.Array,
    skipped: jax.Array,
    stuck: jax.Array,
    **changes: jax.Array,
) -> LossScaleState:
    """The telemetry every policy keeps, plus the policy's own field changes."""
    total = safe_increment(state.total_steps)
    overflows = increment_if(overflow, state.overflow_steps)
    return state.replace(
        last_overflow=overflow,
        last_skipped=skipped,
        stuck=stuck,
        total_steps=total,
        overflow_steps=overflows,
        skipped_steps=increment_if(skipped, state.skipped_steps),
        recent_overflow_rate=recent_rate(state.recent_overflow_rate, overflow, total, overflows),
        **changes,
    )


def clamp(scale: jax.Array, min_scale: float, max_scale: float) -> jax.Array:
    """``scale`` moved into ``[min_scale, max_scale]`` (float32); nan goes to ``min_scale``.

    The identity on every finite scale already in the range, so a state the
    policy produced itself steps exactly as before.
    """
    lo = jnp.asarray(min_scale, jnp.float32)
    hi = jnp.asarray(min(max_scale, F32_MAX), jnp.float32)
    return where(scale >= lo, jnp.minimum(scale, hi), lo)


def with_scale(state: LossScaleState, scale: ArrayLike) -> LossScaleState:
    """``state`` at ``scale``; the counters since the last change restart if it moved.

    Every other field (telemetry, flags) is kept. ``scale`` is broadcast to the
    shape of ``state.scale``, so a state carrying a leading device axis (from
    ``jax.pmap``) keeps its shape.
    """
    scale = jnp.broadcast_to(jnp.asarray(scale, jnp.float32), jnp.shape(state.scale))
    moved = jnp.logical_not(scale == state.scale)  # nan in the old state counts as moved
    zero = jnp.zeros([], jnp.int32)
    return state.replace(
        scale=scale,
        growth_count=where(moved, zero, state.growth_count),
        hysteresis_count=where(moved, zero, state.hysteresis_count),
    )


def unlanded_step(
    before: LossScaleState, adjusted: LossScaleState, overflow: jax.Array, cannot_land: Any
) -> tuple[LossScaleState, jax.Array | None]:
    """``(state, unlanded)``: a step whose update cannot land in float16 parameters.

    Rule (``cannot_land``: the landing check's bool, ``None`` where it did not look)::

      unlanded = cannot_land and not adjusted.last_skipped   # the policy would apply
      state = before, the step recorded skipped and stuck (not as an overflow: overflow is
              the gradients'), the policy's own fields (scale, counters, range,
              policy_state) as they were: no scale changes where an update lands
              if unlanded else adjusted
    """
    if cannot_land is None:
        return adjusted, None
    unlanded = jnp.logical_and(cannot_land, jnp.logical_not(adjusted.last_skipped))
    if jax.tree_util.tree_structure(before.policy_state) != jax.tree_util.tree_structure(
        adjusted.policy_state
    ):  # a state of another policy, conformed by adjust: keep the conformed one
        before = before.replace(policy_state=adjusted.policy_state)
    true = jnp.ones([], jnp.bool_)
    kept = record_step(before, overflow, true, true)
    state = jax.tree_util.tree_map(lambda k, a: where(unlanded, k, a), kept, adjusted)
    return state, unlanded
