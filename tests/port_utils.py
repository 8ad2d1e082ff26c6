"""Helpers for the tests ported from the peers' own test files (``test_upstream_*.py``).

Each ported test names its upstream file and test and keeps upstream's numbers; these helpers
only run a policy over a sequence of overflow flags, compiled once per policy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(jax.jit, static_argnums=0)
def _scan(policy, state, flags):
    def body(s, f):
        s = policy.adjust(s, f)
        return s, (s.scale, s.growth_count, s.hysteresis_count, s.last_skipped, s.stuck)

    return jax.lax.scan(body, state, flags)


def run(policy, flags, state=None):
    """``(final_state, per-step dict)`` of ``policy`` over ``flags`` (True = overflow)."""
    state = policy.init() if state is None else state
    final, (scale, growth, hyst, skipped, stuck) = _scan(
        policy, state, jnp.asarray(np.asarray(flags, bool))
    )
    steps = dict(
        scale=np.asarray(scale),
        growth_count=np.asarray(growth),
        hysteresis_count=np.asarray(hyst),
        skipped=np.asarray(skipped),
        stuck=np.asarray(stuck),
    )
    return final, steps


def scales(policy, flags, state=None):
    """The scale after each step."""
    return run(policy, flags, state)[1]["scale"]
