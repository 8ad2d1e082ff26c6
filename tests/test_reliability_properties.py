"""Property tests: random gradient trees (shapes, dtypes, leaf counts) and fault patterns.

The transformation equals a NumPy reference model of one loss-scaling step; updates keep the
parameters' dtypes; a skipped step changes nothing but the loss-scale state.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import FLOAT16_PARAMS, bits  # tests/ is on sys.path under pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lossscale_jax as lsj

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
SHAPES = [(), (1,), (3,), (2, 3)]
FAULTS = [np.inf, -np.inf, np.nan, 65504.0, -65504.0, 1e5, -7e4]


@st.composite
def cases(draw):
    n = draw(st.integers(1, 4))
    leaves = []
    for i in range(n):
        shape = draw(st.sampled_from(SHAPES))
        gdt = draw(st.sampled_from(list(DTYPES)))
        pdt = draw(st.sampled_from(["float32", gdt]))
        size = int(np.prod(shape))
        values = draw(st.lists(st.floats(-60.0, 60.0, width=16), min_size=size, max_size=size))
        leaves.append((f"l{i}", shape, gdt, pdt, values))
    steps = draw(st.integers(1, 3))
    faults = [
        draw(
            st.lists(
                st.tuples(st.integers(0, n - 1), st.integers(0, 5), st.sampled_from(FAULTS)),
                max_size=2,
            )
        )
        for _ in range(steps)
    ]
    mode = draw(st.sampled_from(["ieee", "saturating", "both"]))
    scale = draw(st.sampled_from([1.0, 2.0**4, 2.0**10]))
    return leaves, faults, mode, scale


POLICY = lsj.DynamicScale(init_scale=1.0, growth_interval=1, min_scale=1.0, max_scale=2.0**12)


@functools.cache
def transformation(mode, inner):
    """One transformation and jitted update per mode: repeated tree signatures hit jit's cache."""
    tx = lsj.loss_scaling(
        {"sgd": optax.sgd(0.5), "adamw": optax.adamw(1e-2)}[inner], POLICY, overflow=mode
    )
    return tx, jax.jit(tx.update)


def init_at(tx, params, scale):
    state = tx.init(params)
    return state._replace(loss_scale=state.loss_scale.replace(scale=jnp.float32(scale)))


def build(leaves, fault_list):
    grads, params = {}, {}
    for name, shape, gdt, pdt, values in leaves:
        g = np.asarray(values, np.float32).astype(DTYPES[gdt]).reshape(shape)
        for leaf, pos, value in fault_list:
            if f"l{leaf}" == name:
                with warnings.catch_warnings():  # 1e5 overflows float16 on purpose
                    warnings.simplefilter("ignore", RuntimeWarning)
                    g.reshape(-1)[pos % max(g.size, 1)] = DTYPES[gdt](value)
        grads[name] = g
        p = np.linspace(-1.0, 1.0, int(np.prod(shape))).reshape(shape)
        params[name] = p.astype(DTYPES[pdt])
    return grads, params


def reference_step(grads, params, scale, mode, policy):
    """Plain NumPy: flag, unscale in float32 to the param dtype, SGD(0.5) or -0.0; new scale."""
    flat = [np.asarray(g, np.float64).ravel() for g in grads.values()]
    ieee = any(not np.all(np.isfinite(f)) for f in flat)
    sat = any(np.any(np.abs(f) >= 65504.0) for f in flat)  # nan compares False
    overflow = {"ieee": ieee, "saturating": sat, "both": ieee or sat}[mode]
    inv = np.float32(1.0) / np.float32(scale)
    updates = {}
    for k, g in grads.items():
        pdt = params[k].dtype
        if overflow:  # -0.0: params + updates is bit-identical to params, -0.0 included
            updates[k] = np.full(g.shape, -0.0, pdt)
        else:
            unscaled = (g.astype(np.float32) * inv).astype(pdt)
            updates[k] = (unscaled * pdt.type(-0.5)).astype(pdt)
    if overflow:
        new_scale = max(np.float32(scale) * np.float32(0.5), np.float32(policy.min_scale))
    else:  # growth_interval=1: every good step grows
        new_scale = min(np.float32(scale) * np.float32(2.0), np.float32(policy.max_scale))
    return overflow, updates, np.float32(new_scale)


@FLOAT16_PARAMS
@pytest.mark.slow
@settings(max_examples=14)
@given(cases())
def test_equals_reference_and_keeps_dtypes(case):
    leaves, faults, mode, scale = case
    policy = POLICY
    tx, update = transformation(mode, "sgd")
    _, params = build(leaves, [])
    state = init_at(tx, params, scale)
    for fault_list in faults:
        grads, _ = build(leaves, fault_list)
        want_overflow, want_updates, want_scale = reference_step(
            grads, params, float(state.loss_scale.scale), mode, policy
        )
        updates, state = update(grads, state, params)
        assert bool(state.loss_scale.last_overflow) == want_overflow
        assert bool(state.loss_scale.last_skipped) == want_overflow
        assert np.float32(state.loss_scale.scale) == want_scale
        for k in grads:
            assert bits(updates[k]) == bits(want_updates[k]), (k, updates[k], want_updates[k])
        ls = state.loss_scale
        assert ls.scale.dtype == jnp.float32 and ls.total_steps.dtype == jnp.int32
        assert ls.last_overflow.dtype == jnp.bool_


@FLOAT16_PARAMS
@pytest.mark.slow
@settings(max_examples=8)
@given(cases())
def test_a_skipped_step_changes_only_the_loss_scale_state(case):
    leaves, faults, mode, scale = case
    tx, update = transformation(mode, "adamw")
    grads0, params = build(leaves, [])
    # A good step first, so that Adam's moments are not zero.
    _, state = update(grads0, init_at(tx, params, scale), params)
    for fault_list in faults:
        grads, _ = build(leaves, fault_list)
        updates, new_state = update(grads, state, params)
        if bool(new_state.loss_scale.last_skipped):
            assert jax.tree_util.tree_map(bits, new_state.inner_state) == jax.tree_util.tree_map(
                bits, state.inner_state
            )
            assert all(not np.any(np.asarray(u)) for u in jax.tree_util.tree_leaves(updates))
            skipped = int(state.loss_scale.skipped_steps)
            assert int(new_state.loss_scale.skipped_steps) == skipped + 1
        for k in params:
            assert updates[k].dtype == params[k].dtype
        state = new_state
