"""Gradient accumulation: an overflow in any micro-batch skips the whole window in every mode,
the scale is constant within a window, and the accumulator never holds a non-finite value."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (  # tests/ is on sys.path under pytest
    FLOAT16_PARAMS,
    all_finite,
    multisteps_state,
)

import lossscale_jax as lsj

K = 3
PARAMS = {"b": jnp.zeros((2,), jnp.float32), "w": jnp.full((2, 3), 0.5, jnp.float32)}
FAULTS = {"inf": np.inf, "-inf": -np.inf, "nan": np.nan, "+65504": 65504.0, "-65504": -65504.0}
SEEN = {
    "ieee": ("inf", "-inf", "nan"),
    "saturating": ("inf", "-inf", "+65504", "-65504"),
    "both": tuple(FAULTS),
}


def micro_grads(t, fault=None):
    rng = np.random.default_rng(t)
    g = {k: rng.normal(0.0, 4.0, v.shape).astype(np.float16) for k, v in PARAMS.items()}
    if fault is not None:
        g["w"][1, 2] = FAULTS[fault]
    return {k: jnp.asarray(v) for k, v in g.items()}


@functools.cache
def jitted(mode):
    tx = lsj.loss_scaling_multi_steps(
        optax.adam(1e-2), lsj.DynamicScale(init_scale=2.0**10), K, overflow=mode
    )
    return tx, jax.jit(tx.update)


@pytest.mark.parametrize("mode", ["ieee", "saturating", "both"])
def test_any_micro_batch_overflow_skips_the_window(mode):
    tx, update = jitted(mode)
    for fault in SEEN[mode]:
        for bad_at in range(K):
            state = tx.init(PARAMS)
            inner0 = state.inner_state
            for j in range(K):
                g = micro_grads(j, fault if j == bad_at else None)
                updates, state = update(g, state, PARAMS)
                assert all_finite(state), (fault, bad_at, j)  # the accumulator stays finite
                assert not any(bool(jnp.any(u)) for u in jax.tree_util.tree_leaves(updates))
                expected_scale = 2.0**10 if j < K - 1 else 2.0**9  # adjusted at the window end
                assert float(state.loss_scale.scale) == expected_scale
            assert bool(state.loss_scale.last_skipped) and int(state.loss_scale.skipped_steps) == 1
            assert jax.tree_util.tree_all(
                jax.tree_util.tree_map(
                    lambda a, b: bool(jnp.all(a == b)), state.inner_state, inner0
                )
            )
            assert int(state.mini_step) == 0 and not bool(state.window_overflow)


def test_multisteps_hides_a_saturated_micro_batch():
    """The contrast: MultiSteps averages 65504 into 65504/k before loss_scaling can see it."""
    inner = lsj.loss_scaling(optax.sgd(0.1), lsj.StaticScale(2.0**10), overflow="saturating")
    tx = optax.MultiSteps(inner, every_k_schedule=K)  # its init refuses: the state by hand
    state, update = multisteps_state(K, inner, PARAMS), jax.jit(tx.update)
    for j in range(K):
        updates, state = update(micro_grads(j, "+65504" if j == 0 else None), state, PARAMS)
    ls = state.inner_opt_state.loss_scale  # read directly: lsj's lookups refuse this nesting
    assert not bool(ls.last_overflow) and bool(jnp.any(updates["w"]))  # missed: applied
    # The accumulation-aware form sees it.
    tx2 = lsj.loss_scaling_multi_steps(
        optax.sgd(0.1), lsj.StaticScale(2.0**10), K, overflow="saturating"
    )
    state2, update2 = tx2.init(PARAMS), jax.jit(tx2.update)
    for j in range(K):
        updates2, state2 = update2(micro_grads(j, "+65504" if j == 0 else None), state2, PARAMS)
    assert bool(state2.loss_scale.last_skipped) and not bool(jnp.any(updates2["w"]))


def test_multisteps_accumulator_keeps_nan_after_the_window():
    """MultiSteps(loss_scaling(...)): its accumulator holds inf, then nan for good (nan * 0)."""
    inner = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale())
    tx = optax.MultiSteps(inner, K)  # its init refuses: the state by hand
    state, update = multisteps_state(K, inner, PARAMS), jax.jit(tx.update)
    for j in range(2 * K):  # one bad micro-batch, then a whole good window
        _, state = update(micro_grads(j, "inf" if j == 0 else None), state, PARAMS)
    assert not all_finite(state.acc_grads)
    assert int(state.inner_opt_state.loss_scale.skipped_steps) == 2  # the good window skipped
    tx2 = lsj.loss_scaling_multi_steps(optax.sgd(0.1), lsj.DynamicScale(), K)
    _, state2 = jax.jit(tx2.update)(micro_grads(0, "inf"), tx2.init(PARAMS), PARAMS)
    assert all_finite(state2)


def test_the_other_nestings_are_refused():
    """loss_scaling(MultiSteps(...)) would change the scale inside a window and drop the bad
    micro-batch instead of skipping the window; MultiSteps(loss_scaling(...)) is read-refused."""
    tx = lsj.loss_scaling(optax.MultiSteps(optax.sgd(0.1), K), lsj.DynamicScale(init_scale=8.0))
    with pytest.raises(ValueError, match="inner holds optax.MultiSteps"):
        tx.init(PARAMS)
    outside = optax.MultiSteps(lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale()), K)
    with pytest.raises(ValueError, match="loss_scaling_multi_steps"):
        lsj.metrics(outside.init(PARAMS))


def reference_window_run(grads_seq, policy, lr, mode):
    """Plain NumPy: per window, skip if any micro-batch overflowed, else SGD on the mean."""
    params = {k: np.asarray(v) for k, v in PARAMS.items()}
    scale, growth = np.float32(policy.init_scale), 0
    out = []
    for w in range(len(grads_seq) // K):
        window = grads_seq[w * K : (w + 1) * K]
        flat = [np.concatenate([np.ravel(g[k]) for k in sorted(g)]) for g in window]
        inf_nan = any(not np.all(np.isfinite(f)) for f in flat)
        sat = any(np.any(np.abs(f.astype(np.float32)) >= 65504.0) for f in flat)
        bad = {"ieee": inf_nan, "saturating": sat, "both": inf_nan or sat}[mode]
        inv = np.float32(1.0) / scale
        if bad:
            scale, growth = max(np.float32(scale * np.float32(0.5)), np.float32(1.0)), 0
        else:
            for k in params:
                acc = np.zeros_like(params[k])
                for g in window:
                    acc = acc + np.asarray(g[k]).astype(np.float32) * inv
                params[k] = params[k] + np.float32(-lr) * (acc / np.float32(K))
            growth += 1
            if growth >= policy.growth_interval:
                scale, growth = np.float32(scale * np.float32(2.0)), 0
        out.append((bad, float(scale), {k: v.copy() for k, v in params.items()}))
    return out


@pytest.mark.parametrize("mode", ["ieee", "saturating", "both"])
def test_matches_reference_model(mode):
    policy = lsj.DynamicScale(init_scale=2.0**6, growth_interval=2)
    tx = lsj.loss_scaling_multi_steps(optax.sgd(0.1), policy, K, overflow=mode)
    update = jax.jit(tx.update)
    rng = np.random.default_rng(7)
    seq = []
    for t in range(8 * K):
        fault = list(FAULTS)[rng.integers(len(FAULTS))] if rng.random() < 0.15 else None
        seq.append(micro_grads(100 + t, fault))
    ref = reference_window_run(seq, policy, 0.1, mode)
    params, state = PARAMS, tx.init(PARAMS)
    scales_seen = []
    for t, g in enumerate(seq):
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
        scales_seen.append(float(state.loss_scale.scale))
        if t % K == K - 1:
            bad, scale, ref_params = ref[t // K]
            assert bool(state.loss_scale.last_skipped) == bad
            assert float(state.loss_scale.scale) == scale
            for k in ref_params:
                np.testing.assert_allclose(np.asarray(params[k]), ref_params[k], rtol=1e-6)
    assert sum(b for b, _, _ in ref) > 0 and sum(not b for b, _, _ in ref) > 0
    # The scale changes only at window ends.
    for t in range(len(seq)):
        if t % K != K - 1:
            assert scales_seen[t] == (scales_seen[t - 1] if t else policy.init_scale)
    assert int(state.loss_scale.total_steps) == len(seq) // K


def test_every_k_1_is_loss_scaling():
    policy = lsj.DynamicScale(init_scale=2.0**6, growth_interval=2)
    a = lsj.loss_scaling(optax.adam(1e-2), policy, overflow="both")
    b = lsj.loss_scaling_multi_steps(optax.adam(1e-2), policy, 1, overflow="both")
    sa, sb = a.init(PARAMS), b.init(PARAMS)
    ua_, ub_ = jax.jit(a.update), jax.jit(b.update)
    for t, fault in enumerate([None, "inf", None, "+65504", None, None, "nan", None]):
        g = micro_grads(t, fault)
        ua, sa = ua_(g, sa, PARAMS)
        ub, sb = ub_(g, sb, PARAMS)
        for x, y in zip(
            jax.tree_util.tree_leaves(sa.loss_scale),
            jax.tree_util.tree_leaves(sb.loss_scale),
            strict=True,
        ):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
        # Same arithmetic, other fusions: equal to the last bit or one.
        for x, y in zip(
            jax.tree_util.tree_leaves((ua, sa.inner_state)),
            jax.tree_util.tree_leaves((ub, sb.inner_state)),
            strict=True,
        ):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-9)


@FLOAT16_PARAMS
def test_dtypes_and_non_float_leaves():
    params = {
        "h": jnp.zeros(3, jnp.float16),
        "bf": jnp.zeros(2, jnp.bfloat16),
        "f": jnp.zeros(2, jnp.float32),
        "i": jnp.zeros(2, jnp.int32),
    }
    tx = lsj.loss_scaling_multi_steps(optax.sgd(0.1), lsj.StaticScale(4.0), 2)
    state = tx.init(params)
    assert state.acc_grads["h"].dtype == jnp.float32 and state.acc_grads["bf"].dtype == jnp.float32
    grads = {
        "h": jnp.ones(3, jnp.float16),
        "bf": jnp.ones(2, jnp.bfloat16),
        "f": jnp.ones(2, jnp.float32),
        "i": np.zeros(2, jax.dtypes.float0),  # jax.grad(..., allow_int=True)'s
    }
    tx = lsj.loss_scaling_multi_steps(optax.identity(), lsj.StaticScale(4.0), 2)
    state, update = tx.init(params), jax.jit(tx.update)
    for _ in range(2):
        updates, state = update(grads, state, params)
    floats = ("h", "bf", "f")
    assert {k: updates[k].dtype for k in floats} == {k: params[k].dtype for k in floats}
    assert float(updates["f"][0]) == 0.25 and float(updates["h"][0]) == 0.25
    assert updates["i"].dtype == jax.dtypes.float0  # no value: passed through
    # An integer gradient would reach the window's sum scaled: refused, naming the leaf.
    with pytest.raises(lsj.errors.GradientDtypeError, match=r"\['i'\] is int32"):
        update({**grads, "i": jnp.full(2, 7, jnp.int32)}, state, params)


@pytest.mark.multidevice
@pytest.mark.slow
def test_axis_name_every_device_skips_the_window():
    n = 4
    tx = lsj.loss_scaling_multi_steps(
        optax.sgd(0.1),
        lsj.DynamicScale(init_scale=8.0),
        2,
        overflow="saturating",
        axis_name="batch",
    )
    params = jax.tree_util.tree_map(lambda a: jnp.stack([a] * n), PARAMS)
    state = jax.pmap(tx.init)(params)
    step = jax.pmap(tx.update, axis_name="batch")
    g0 = [micro_grads(d, "+65504" if d == 2 else None) for d in range(n)]  # one device saturates
    g1 = [micro_grads(10 + d) for d in range(n)]
    stack = lambda gs: jax.tree_util.tree_map(lambda *x: jnp.stack(x), *gs)  # noqa: E731
    _, state = step(stack(g0), state, params)
    updates, state = step(stack(g1), state, params)
    assert np.asarray(state.loss_scale.last_skipped).tolist() == [True] * n
    assert np.asarray(state.loss_scale.scale).tolist() == [4.0] * n
    assert not np.any(np.asarray(updates["w"]))


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(every_k=0), ValueError, "every_k"),
        (dict(every_k=2.0), TypeError, "every_k"),
        (dict(every_k=2, overflow="nan"), ValueError, "overflow"),
        (dict(every_k=2, axis_name=()), ValueError, "axis_name"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        lsj.loss_scaling_multi_steps(optax.sgd(0.1), lsj.DynamicScale(), **kwargs)


def test_scale_loss_and_metrics_find_the_state():
    tx = lsj.loss_scaling_multi_steps(optax.sgd(0.1), lsj.StaticScale(16.0), 2)
    state = tx.init(PARAMS)
    assert float(lsj.scale_loss(jnp.float32(0.5), state)) == 8.0
    assert float(lsj.metrics(state)["loss_scale"]) == 16.0
    with pytest.raises(TypeError, match="LossScalingMultiStepsState"):
        tx.update(micro_grads(0), optax.sgd(0.1).init(PARAMS), PARAMS)


def test_traces_once_and_keeps_state_dtypes():
    tx = lsj.loss_scaling_multi_steps(optax.adam(1e-2), lsj.DynamicScale(), K, overflow="both")
    traces = []

    @jax.jit
    def step(g, s):
        traces.append(1)
        return tx.update(g, s, PARAMS)

    state = tx.init(PARAMS)
    dtypes0 = jax.tree_util.tree_map(lambda x: x.dtype, state)
    for t in range(2 * K + 1):
        _, state = step(micro_grads(t, "inf" if t == 1 else None), state)
    assert len(traces) == 1
    assert jax.tree_util.tree_map(lambda x: x.dtype, state) == dtypes0
