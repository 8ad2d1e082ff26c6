"""The stuck scale: overflows at the floor skip (default) or raise; the inner optimizer never
sees a non-finite gradient, unlike optax.apply_if_finite."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import all_finite, assert_bits_equal  # tests/ is on sys.path under pytest
from jax.experimental import checkify

import lossscale_jax as lsj

PARAMS = {"w": jnp.array([0.5, -1.0, 2.0], jnp.float32)}
BAD = {"w": jnp.array([1.0, jnp.inf, 0.0], jnp.float16)}
GOOD = {"w": jnp.array([1.0, 2.0, -3.0], jnp.float16)}


def test_default_keeps_skipping_at_the_floor():
    policy = lsj.DynamicScale(init_scale=4.0, min_scale=1.0)
    tx = lsj.loss_scaling(optax.adam(1e-2), policy)
    step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    state = tx.init(PARAMS)
    inner0 = state.inner_state
    stuck, scales = [], []
    for _ in range(6):
        updates, state = step(BAD, state, PARAMS)
        assert not np.any(np.asarray(updates["w"]))
        stuck.append(bool(lsj.metrics(state)["stuck"]))
        scales.append(float(state.loss_scale.scale))
    # By hand: 4 -> 2 -> 1 -> 1 ...; stuck once a step overflows with the scale at 1.
    assert scales == [2.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert stuck == [False, False, True, True, True, True]
    assert_bits_equal(state.inner_state, inner0)
    # Recovery: the first good step applies Adam's first update (count 1).
    updates, state = step(GOOD, state, PARAMS)
    assert not bool(lsj.metrics(state)["stuck"])
    assert int(state.inner_state[0].count) == 1 and all_finite(updates)


def test_host_loop_can_raise_on_the_stuck_flag():
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=2.0, min_scale=1.0))
    step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    state = tx.init(PARAMS)
    with pytest.raises(FloatingPointError, match="stuck at step 2"):
        for i in range(1, 10):
            _, state = step(BAD, state, PARAMS)
            if lsj.metrics(state)["stuck"]:  # one scalar read per step, chosen by the user
                raise FloatingPointError(f"stuck at step {i}")


def test_on_stuck_error_raises_through_checkify():
    tx = lsj.loss_scaling(
        optax.adam(1e-2), lsj.DynamicScale(init_scale=2.0, min_scale=1.0), on_stuck="error"
    )
    step = jax.jit(checkify.checkify(lambda g, s, p: tx.update(g, s, p)))
    state = tx.init(PARAMS)
    inner0 = state.inner_state
    err, (_, state) = step(BAD, state, PARAMS)  # 2 -> 1: backed off, not stuck
    assert err.get() is None
    err, (updates, state) = step(BAD, state, PARAMS)  # overflow at 1: stuck
    assert "loss scaling is stuck" in err.get() and "scale=1.0" in err.get()
    with pytest.raises(checkify.JaxRuntimeError, match="stuck"):
        err.throw()
    # The step was still skipped: the inner state never saw the inf.
    assert not np.any(np.asarray(updates["w"]))
    assert_bits_equal(state.inner_state, inner0)
    err, _ = step(GOOD, state, PARAMS)
    assert err.get() is None


def test_on_stuck_error_with_static_scale_fires_on_every_overflow():
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.StaticScale(8.0), on_stuck="error")
    step = jax.jit(checkify.checkify(lambda g, s, p: tx.update(g, s, p)))
    state = tx.init(PARAMS)
    assert step(GOOD, state, PARAMS)[0].get() is None
    assert "stuck" in step(BAD, state, PARAMS)[0].get()


def test_on_stuck_error_needs_checkify_under_jit():
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.StaticScale(8.0), on_stuck="error")
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match="checkify"):
        jax.jit(lambda g, s, p: tx.update(g, s, p))(GOOD, state, PARAMS)


def test_on_stuck_error_in_the_accumulating_form():
    tx = lsj.loss_scaling_multi_steps(
        optax.sgd(0.1), lsj.DynamicScale(init_scale=1.0, min_scale=1.0), 2, on_stuck="error"
    )
    step = jax.jit(checkify.checkify(lambda g, s, p: tx.update(g, s, p)))
    state = tx.init(PARAMS)
    err, (_, state) = step(BAD, state, PARAMS)  # mid-window: no decision yet
    assert err.get() is None
    err, (_, state) = step(GOOD, state, PARAMS)  # window end: overflow at the floor
    assert "stuck" in err.get()


@pytest.mark.parametrize("front", ["loss_scaling", "fused", "multi_steps", "layerwise"])
def test_on_stuck_error_names_an_update_that_cannot_land(front):
    # A float16 parameter near the top of its range, an SGD step that would take it past
    # 65504: the step is skipped as unlanded, and on_stuck="error" says so, naming the leaf
    # and lsj.master_weights, on the step that decides (a window's end) and no other.
    params = {"h": jnp.array([62000.0, 1.0], jnp.float16), "w": jnp.ones(2)}
    grads = {"h": jnp.array([-4096.0, 0.0], jnp.float16), "w": jnp.ones(2, jnp.float16)}
    with pytest.warns(lsj.errors.Float16OptimizerWarning, match=r"\['h'\]"):
        if front == "layerwise":

            def lw_loss(p):  # d loss / d h = grads["h"], through one layer tap
                return jnp.sum(lsj.tap(p["h"], "l0") * grads["h"]) + jnp.sum(p["w"])

            layers = lsj.layerwise.discover(lw_loss, params)
            policy = lsj.HeadroomScale(init_scale=1.0, min_scale=1.0)
            tx = lsj.layerwise_scaling(optax.sgd(1.0), layers, policy, on_stuck="error")
        elif front == "multi_steps":
            tx = lsj.loss_scaling_multi_steps(
                optax.sgd(1.0), lsj.StaticScale(1.0), 2, on_stuck="error"
            )
        else:
            tx = lsj.loss_scaling(
                optax.sgd(1.0), lsj.DynamicScale(init_scale=1.0), on_stuck="error"
            )
        state = tx.init(params)
    if front == "layerwise":
        scaled = lambda p, s: lsj.scale_loss(lw_loss(p), s)  # noqa: E731
        _, grads, taps = lsj.layerwise.value_and_grad(scaled, layers, state)(params, state)
        run = lambda g, s, p: lsj.apply_gradients(tx, g, s, p, taps=taps)  # noqa: E731
    elif front == "fused":
        run = lambda g, s, p: lsj.apply_gradients(tx, g, s, p)  # noqa: E731
    else:
        run = lambda g, s, p: tx.update(g, s, p)  # noqa: E731
    step = jax.jit(checkify.checkify(run))
    if front == "multi_steps":  # mid-window: nothing decided, nothing said
        err, (_, state) = step(grads, state, params)
        assert err.get() is None
    err, (out, state) = step(grads, state, params)
    message = err.get()
    assert message is not None and "cannot land the update" in message
    assert "float16 parameters (of ['h']" in message and "lsj.master_weights(inner)" in message
    m = lsj.metrics(state)
    assert bool(m["unlanded"]) and bool(m["stuck"]) and not bool(m["overflow"])
    assert float(m["loss_scale"]) == 1.0 and int(m["overflow_steps"]) == 0


@pytest.mark.parametrize("bad", ["raise", None, True, "Skip"])
def test_on_stuck_is_validated(bad):
    with pytest.raises(ValueError, match="on_stuck"):
        lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(), on_stuck=bad)
    with pytest.raises(ValueError, match="on_stuck"):
        lsj.loss_scaling_multi_steps(optax.sgd(0.1), lsj.DynamicScale(), 2, on_stuck=bad)


def test_apply_if_finite_poisons_adam_where_loss_scaling_does_not():
    """optax.apply_if_finite hands nan to Adam after max_consecutive_errors; we never do."""
    # float32 gradients: apply_if_finite's skip branch keeps the gradients' dtype.
    nan = {"w": jnp.array([1.0, jnp.nan, 0.0], jnp.float32)}
    schedule = [nan] * 5 + [{"w": GOOD["w"].astype(jnp.float32)}] * 5

    def run(tx):
        params, state = PARAMS, tx.init(PARAMS)
        step = jax.jit(lambda g, s, p: tx.update(g, s, p))
        for g in schedule:
            updates, state = step(g, state, params)
            params = optax.apply_updates(params, updates)
        return params, state

    params, state = run(optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=3))
    # The fourth nan went into Adam: its moments and the params are nan for good.
    assert np.isnan(np.asarray(state.inner_state[0].mu["w"])).any()
    assert np.isnan(np.asarray(params["w"])).any()

    for policy in (lsj.DynamicScale(init_scale=2.0, min_scale=1.0), lsj.StaticScale(1.0)):
        params, state = run(lsj.loss_scaling(optax.adam(1e-2), policy))
        assert all_finite(params) and all_finite(state)
        assert int(state.inner_state[0].count) == 5  # only the good steps reached Adam
        assert int(lsj.metrics(state)["skipped_steps"]) == 5
