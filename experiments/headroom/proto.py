"""A prototype of the headroom policy, built outside the library on its public pieces.

``ProtoState`` is a ``LossScaleState`` with three more fields: ``amax`` (this step's
measurement, written into the state just before the update by ``measure``), ``peak`` and
``margin`` (the rule's memory; ``growth_count`` counts the good steps toward giving a margin
octave back). ``HeadroomProto.adjust`` is the rule of ``model.py`` in JAX, so it runs inside
``lsj.loss_scaling``'s own update: the skip (one ``lax.cond``, the inner state untouched on a
skipped step) is the library's.

The measurement here is a separate reduction over the scaled gradients (the library version
takes it from the overflow check's own pass).
"""

from __future__ import annotations

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import model
import numpy as np

import lossscale_jax as lsj
from lossscale_jax.engine._state import clamp as _clamp
from lossscale_jax.engine._state import record_step as _record
from lossscale_jax.policies import LossScalePolicy, LossScaleState, initial_state
from lossscale_jax.policies._headroom import pow2_target as _pow2_target

F16_MAX = float(jnp.finfo(jnp.float16).max)


@chex.dataclass
class ProtoState(LossScaleState):
    amax: jax.Array  # float32: max|scaled g| / (scale * F16_MAX) of the step being adjusted
    peak: jax.Array  # float32: the held peak of amax
    # margin (int32, octaves kept below the headroom): LossScaleState's own field since the
    # library has HeadroomScale; this prototype predates it and keeps its peak separately.


@dataclasses.dataclass(frozen=True)
class HeadroomProto(LossScalePolicy):
    """The rule of ``model.Headroom`` (same hyperparameters), as a policy."""

    h: model.Headroom

    def init(self) -> ProtoState:
        s = initial_state(self.h.init_scale)
        return ProtoState(
            **{k: getattr(s, k) for k in s.keys()},
            amax=jnp.zeros([], jnp.float32),
            peak=jnp.zeros([], jnp.float32),
        ).replace(margin=jnp.asarray(self.h.min_margin, jnp.int32))

    def adjust(self, state: ProtoState, overflow) -> ProtoState:
        h = self.h
        f32 = jnp.float32
        overflow = jnp.asarray(overflow, jnp.bool_)
        scale, peak, margin, good = state.scale, state.peak, state.margin, state.growth_count
        zero = jnp.zeros([], jnp.int32)

        # Overflow branch.
        blind = peak == 0
        grown = jnp.minimum(margin + 1, h.max_margin) if h.grow_margin else margin
        margin_bad = jnp.where(blind, margin, grown)
        spent = margin >= h.max_margin if h.grow_margin else jnp.ones([], jnp.bool_)
        bump = {
            "always": jnp.ones([], jnp.bool_),
            "spent": spent,
            "never": jnp.zeros([], jnp.bool_),
        }
        remember = jnp.logical_and(jnp.logical_not(blind), bump[h.bump])
        peak_bad = jnp.where(remember, jnp.maximum(peak, f32(1.0) / scale), peak)
        informed = jnp.minimum(scale * f32(0.5), _pow2_target(peak_bad, margin_bad))
        scale_bad = jnp.where(blind, scale * f32(h.blind_backoff), informed)

        # Good branch.
        peak_good = jnp.maximum(state.amax, peak * f32(h.decay))
        good_good = good + 1
        give_back = jnp.logical_and(good_good >= h.margin_interval, margin > h.min_margin)
        margin_good = jnp.where(give_back, margin - 1, margin)
        good_good = jnp.where(give_back, zero, good_good)
        scale_good = jnp.where(
            peak_good > 0, _pow2_target(peak_good, margin_good), scale * f32(2.0)
        )

        new = jnp.where(overflow, scale_bad, scale_good)
        return _record(
            state,
            overflow,
            overflow,
            stuck=jnp.logical_and(overflow, scale <= f32(h.min_scale)),
            scale=_clamp(new, h.min_scale, h.max_scale),
            growth_count=jnp.where(overflow, zero, good_good).astype(jnp.int32),
            peak=jnp.where(overflow, peak_bad, peak_good),
            margin=jnp.where(overflow, margin_bad, margin_good).astype(jnp.int32),
        )

    def conform(self, state):
        return state

    def __repr__(self) -> str:
        h = self.h
        return (
            f"HeadroomProto(init_scale=2**{round(math.log2(h.init_scale))}, "
            f"min_margin={h.min_margin}, window={h.window:g}, "
            f"margin_interval={h.margin_interval}, max_scale={h.max_scale:g})"
        )


def grad_amax(grads, scale: jax.Array) -> jax.Array:
    """max |scaled g| over every floating leaf / (scale * F16_MAX), float32."""
    leaves = [g for g in jax.tree.leaves(grads) if jnp.issubdtype(g.dtype, jnp.floating)]
    m = jnp.max(jnp.stack([jnp.max(jnp.abs(g)).astype(jnp.float32) for g in leaves]))
    return m / (scale * jnp.float32(F16_MAX))


def measure(opt_state, grads):
    """``opt_state`` with this step's ``amax`` written into its ``ProtoState`` (else as is)."""
    ls = lsj.get_loss_scale_state(opt_state)
    if not isinstance(ls, ProtoState):
        return opt_state
    return opt_state._replace(loss_scale=ls.replace(amax=grad_amax(grads, ls.scale)))


def check_against_model(h: model.Headroom, steps: int = 400, seed: int = 0) -> int:
    """Runs the JAX rule and the NumPy model on one random (overflow, amax) sequence.

    Returns the number of steps compared; raises if any state differs.
    """
    rng = np.random.default_rng(seed)
    logm = np.cumsum(rng.normal(0, 0.4, steps)) - 30
    amax = np.exp2(logm + rng.normal(0, 0.5, steps)).astype(np.float32)
    over = rng.random(steps) < 0.08
    policy = HeadroomProto(h)
    adjust = jax.jit(lambda s, o, a: policy.adjust(s.replace(amax=a), o))
    s = policy.init()
    ref = h.init()
    for t in range(steps):
        s = adjust(s, over[t], amax[t])
        ref = model.step(h, ref, bool(over[t]), amax[t])
        got = dict(scale=s.scale, peak=s.peak, margin=s.margin, good=s.growth_count)
        for k, v in ref.items():
            if np.asarray(got[k]) != v:
                raise AssertionError(f"step {t}: {k} = {got[k]} in JAX, {v} in the model")
    return steps
