"""The loss_scaling transformation: skip semantics, dtypes, tracing, composition."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    FLOAT16_PARAMS,  # tests/ is on sys.path under pytest
    assert_no_host_round_trip,
    assert_trees_equal,
    multisteps_state,
)

import lossscale_jax as lsj


def params_of(dtype=jnp.float32):
    return {
        "w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4).astype(dtype),
        "b": jnp.full((4,), 0.5, dtype),
    }


def grads_like(params, value=1.0, dtype=jnp.float16):
    return jax.tree_util.tree_map(lambda p: jnp.full(p.shape, value, dtype), params)


def make_step(tx):
    @jax.jit
    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, updates

    return step


@functools.cache
def shared_tx_and_step(name: str):
    """A transformation and its jitted step, built once per process: parametrizations that
    differ only in data (the injected value, good or bad) run one compiled step."""
    txs = {
        "skip": lambda: lsj.loss_scaling(optax.adam(1e-2), lsj.DynamicScale(init_scale=2.0**10)),
        "dtypes": lambda: lsj.loss_scaling(optax.adam(1e-3), lsj.DynamicScale(), overflow="both"),
    }
    tx = txs[name]()
    return tx, make_step(tx)


# ------------------------------------------------------------------ skipping


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_overflow_step_is_a_no_op_except_the_scale(bad):
    params = params_of()
    tx, step = shared_tx_and_step("skip")  # one compilation for inf, -inf and nan
    state = tx.init(params)
    params, state, _ = step(params, state, grads_like(params, 3.0))  # one good step first
    grads = grads_like(params, 3.0)
    grads["w"] = grads["w"].at[1, 2].set(bad)
    new_params, new_state, updates = step(params, state, grads)

    assert_trees_equal(new_params, params)
    assert_trees_equal(new_state.inner_state, state.inner_state)
    assert int(new_state.inner_state[0].count) == 1  # Adam's count did not advance
    for u in jax.tree_util.tree_leaves(updates):
        assert not np.any(np.asarray(u))
    ls = lsj.get_loss_scale_state(new_state)
    assert float(ls.scale) == 2.0**9
    assert bool(ls.last_skipped) and int(ls.skipped_steps) == 1 and int(ls.total_steps) == 2


def test_good_step_equals_inner_on_unscaled_grads():
    params = params_of()
    scale = 2.0**12
    tx = lsj.loss_scaling(optax.adam(1e-2), lsj.StaticScale(scale))
    raw = jax.tree_util.tree_map(
        lambda p: jnp.asarray(np.random.default_rng(1).normal(size=p.shape), jnp.float32), params
    )
    scaled = jax.tree_util.tree_map(lambda g: (g * scale).astype(jnp.float16), raw)
    _, state, updates = make_step(tx)(params, tx.init(params), scaled)
    # Reference: Adam on the same float16 gradients divided by the scale in float64.
    unscaled = jax.tree_util.tree_map(
        lambda g: jnp.asarray(np.asarray(g, np.float64) / scale, jnp.float32), scaled
    )
    ref_updates, ref_inner = optax.adam(1e-2).update(unscaled, optax.adam(1e-2).init(params))
    for k in params:
        np.testing.assert_allclose(np.asarray(updates[k]), np.asarray(ref_updates[k]), rtol=1e-6)
    assert int(state.inner_state[0].count) == int(ref_inner[0].count) == 1


def test_small_loss_in_float16_recovered_with_fp32_master_weights():
    # Forward values are normal float16 numbers (all exact), but the loss is
    # weighted by 1e-4, so dL/dw = 2 w x^2 1e-4 ~ 2e-10: below float16's range.
    params = {"w": jnp.array([1.0, 0.5, -0.75], jnp.float32)}
    x = jnp.full((3,), 2.0**-10, jnp.float32)

    def loss(p, dtype):
        # Products in ``dtype``; the reduction in float32, as mixed-precision losses do.
        y = (p["w"].astype(dtype) * x.astype(dtype)).astype(jnp.float32)
        return 1e-4 * jnp.sum(y**2)

    g32 = jax.grad(lambda p: loss(p, jnp.float32))(params)["w"]
    np.testing.assert_allclose(
        np.asarray(g32), 2e-4 * np.array([1.0, 0.5, -0.75]) * 2.0**-20, rtol=1e-6
    )  # derived by hand
    p16 = {"w": params["w"].astype(jnp.float16)}
    g16 = jax.grad(lambda p: loss(p, jnp.float16))(p16)["w"]
    assert not np.any(np.asarray(g16))  # lost without scaling

    scale = 2.0**24
    tx = lsj.loss_scaling(optax.sgd(1.0), lsj.StaticScale(scale))
    state = tx.init(params)
    grads = jax.grad(lambda p: lsj.scale_loss(loss(p, jnp.float16), state))(p16)
    assert grads["w"].dtype == jnp.float16
    updates, _ = jax.jit(tx.update)(grads, state, params)
    assert updates["w"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(-updates["w"]), np.asarray(g32), rtol=2e-3)
    # Unscaling in float16 would have lost them again.
    assert not np.any(np.asarray(grads["w"] / jnp.float16(2.0**14) / jnp.float16(2.0**10)))


# ------------------------------------------------------------------ dtypes


@FLOAT16_PARAMS
@pytest.mark.parametrize("pdtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("bad", [False, True])
def test_dtypes_and_structure_are_stable(pdtype, bad):
    params = params_of(pdtype)
    tx, step = shared_tx_and_step("dtypes")  # one compilation per dtype, good or bad
    state = tx.init(params)
    grads = grads_like(params, np.inf if bad else 1.0, dtype=jnp.float16)
    new_params, new_state, updates = step(params, state, grads)
    for k in params:
        assert updates[k].dtype == pdtype
        assert new_params[k].dtype == pdtype
    assert jax.tree_util.tree_structure(new_state) == jax.tree_util.tree_structure(state)
    for a, b in zip(
        jax.tree_util.tree_leaves(new_state), jax.tree_util.tree_leaves(state), strict=True
    ):
        assert a.dtype == b.dtype and a.shape == b.shape
    ls = lsj.get_loss_scale_state(new_state)
    assert ls.scale.dtype == jnp.float32 and ls.total_steps.dtype == jnp.int32


def test_state_survives_cond():
    tx = lsj.loss_scaling(optax.adam(1e-3), lsj.DynamicScale())
    state = tx.init(params_of())
    out = jax.jit(lambda p, s: jax.lax.cond(p, lambda s: s, lambda s: s, s))(True, state)
    assert_trees_equal(out, state)


# ------------------------------------------------------------------ tracing


def test_one_trace_no_host_sync_across_scale_changes():
    params = params_of()
    tx = lsj.loss_scaling(optax.adam(1e-3), lsj.DynamicScale(init_scale=4.0, growth_interval=2))
    traces = []

    @jax.jit
    def step(params, opt_state, grads):
        traces.append(1)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    state = tx.init(params)
    good, bad = grads_like(params, 1.0), grads_like(params, np.nan)
    params, state = step(params, state, good)  # compile outside the guard
    scales = []
    with jax.transfer_guard("disallow"):
        for g in [good, good, bad, good, bad, good, good, good]:
            params, state = step(params, state, g)
            scales.append(lsj.get_loss_scale_state(state).scale)
    assert len(traces) == 1
    assert len({float(s) for s in scales}) > 1  # the scale did change
    assert_no_host_round_trip(step, params, state, bad)  # what the guard cannot see on CPU


def test_the_host_round_trip_check_fires():
    # A step that prints from inside (a host callback) is what assert_no_host_round_trip
    # catches on every backend.
    @jax.jit
    def step(x):
        jax.debug.print("{}", x)
        return x + 1

    with pytest.raises(AssertionError, match="waits for the host"):
        assert_no_host_round_trip(step, jnp.float32(1))


def test_new_static_value_or_restored_state_does_not_recompile():
    params = params_of()
    tx = lsj.loss_scaling(optax.sgd(1.0), lsj.StaticScale(128.0))
    step = make_step(tx)
    grads = grads_like(params, 256.0)
    _, _, u128 = step(params, tx.init(params), grads)
    other = lsj.loss_scaling(optax.sgd(1.0), lsj.StaticScale(256.0)).init(params)
    _, _, u256 = step(params, other, grads)
    assert step._cache_size() == 1
    np.testing.assert_array_equal(np.asarray(u128["b"]), -2.0)
    np.testing.assert_array_equal(np.asarray(u256["b"]), -1.0)


# ------------------------------------------------------------------ composition


def test_clipping_inside_the_wrapper_sees_unscaled_gradients():
    params = {"w": jnp.zeros(4, jnp.float32)}
    scale = 1024.0
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    tx = lsj.loss_scaling(inner, lsj.StaticScale(scale))
    unscaled = jnp.array([0.1, 0.2, 0.0, 0.0], jnp.float32)  # norm < 1: no clipping
    grads = {"w": (unscaled * scale).astype(jnp.float16)}
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(np.asarray(updates["w"]), -np.asarray(unscaled), rtol=1e-3)
    big = {"w": jnp.array([3.0, 4.0, 0.0, 0.0], jnp.float32) * scale}  # norm 5: clipped to 1
    updates, _ = tx.update({"w": big["w"].astype(jnp.float16)}, tx.init(params), params)
    np.testing.assert_allclose(np.asarray(updates["w"]), [-0.6, -0.8, 0, 0], rtol=1e-3)


def test_multisteps_outside_is_refused_where_the_state_is_read():
    params = params_of()
    inner = lsj.loss_scaling(optax.sgd(1.0), lsj.DynamicScale(init_scale=8.0))
    tx = optax.MultiSteps(inner, every_k_schedule=2)
    # Refused when built (a trainer's own accumulation may never read the state) ...
    with pytest.raises(lsj.errors.NestingError, match=r"optax\.MultiSteps.*multi_steps"):
        tx.init(params)
    # ... and wherever a state built around it is read.
    state = multisteps_state(2, inner, params)
    for read in (lsj.get_loss_scale_state, lsj.metrics, lambda s: lsj.scale_loss(1.0, s)):
        with pytest.raises(ValueError, match=r"optax\.MultiSteps.*loss_scaling_multi_steps"):
            read(state)


def test_multisteps_outside_never_recovers_from_one_inf_micro_batch():
    """Why MultiSteps(loss_scaling(...)) is refused: its accumulator reset (1 - emit) * acc
    keeps nan * 0 = nan, so every later window is skipped and the scale halves for good."""
    params = params_of()
    inner = lsj.loss_scaling(optax.sgd(1.0), lsj.DynamicScale(init_scale=2.0**10))
    tx = optax.MultiSteps(inner, every_k_schedule=2)  # its init refuses: the state by hand
    state, update = multisteps_state(2, inner, params), jax.jit(tx.update)
    _, state = update(grads_like(params, np.inf), state, params)  # window 1: inf, then good
    _, state = update(grads_like(params, 1.0), state, params)
    for _ in range(3):  # three windows of good micro-batches after it
        for _ in range(2):
            updates, state = update(grads_like(params, 1.0), state, params)
    ls = state.inner_opt_state.loss_scale  # read directly: the lookups refuse this nesting
    assert int(ls.skipped_steps) == 4 and float(ls.scale) == 2.0**6  # all four windows
    assert not np.all(np.isfinite(np.asarray(state.acc_grads["b"])))


def test_inject_hyperparams_inside():
    params = params_of()
    tx = lsj.loss_scaling(
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.5), lsj.StaticScale(4.0)
    )
    state = tx.init(params)
    updates, state = tx.update(grads_like(params, 4.0), state, params)
    np.testing.assert_allclose(np.asarray(updates["b"]), -0.5)
    state.inner_state.hyperparams["learning_rate"] = jnp.asarray(0.25)
    updates, _ = tx.update(grads_like(params, 4.0), state, params)
    np.testing.assert_allclose(np.asarray(updates["b"]), -0.25)


def test_chain_and_inject_hyperparams_outside_lookup():
    params = params_of()
    alone = optax.chain(lsj.loss_scaling(optax.sgd(1.0), lsj.StaticScale(32.0)))
    assert float(lsj.get_loss_scale_state(alone.init(params)).scale) == 32.0
    # With another transformation beside it, the chain is refused (clipping scaled gradients,
    # weight decay on skipped steps), stateless or not.
    wrapped = optax.chain(optax.identity(), lsj.loss_scaling(optax.sgd(1.0), lsj.StaticScale(32.0)))
    with pytest.raises(ValueError, match="one of 2 transformations in an optax.chain"):
        lsj.get_loss_scale_state(wrapped.init(params))
    injected = optax.inject_hyperparams(
        lambda learning_rate: lsj.loss_scaling(optax.sgd(learning_rate), lsj.StaticScale(16.0))
    )(learning_rate=0.1)
    with pytest.raises(ValueError, match="wrapped in optax.inject_hyperparams"):
        lsj.scale_loss(jnp.float32(2.0), injected.init(params))


def test_extra_args_pass_through():
    params = params_of()
    inner = optax.contrib.reduce_on_plateau(patience=1) if hasattr(optax, "contrib") else None
    if inner is None:  # pragma: no cover
        pytest.skip("optax.contrib unavailable")
    tx = lsj.loss_scaling(optax.chain(optax.sgd(1.0), inner), lsj.StaticScale(2.0))
    state = tx.init(params)
    _, state = tx.update(grads_like(params, 2.0), state, params, value=jnp.float32(3.0))
    assert float(state.inner_state[1].best_value) == 3.0


# ------------------------------------------------------------------ metrics & lookups


def test_metrics_values():
    params = params_of()
    tx = lsj.loss_scaling(optax.sgd(1.0), lsj.DynamicScale(init_scale=16.0))
    step = make_step(tx)
    state = tx.init(params)
    m = lsj.metrics(state)
    assert float(m["overflow_rate"]) == 0.0 and int(m["total_steps"]) == 0
    for v in [1.0, np.inf, 1.0, 1.0]:
        params, state, _ = step(params, state, grads_like(params, v))
    m = jax.jit(lsj.metrics)(state)
    assert float(m["loss_scale"]) == 8.0
    assert int(m["total_steps"]) == 4 and int(m["skipped_steps"]) == 1
    assert float(m["overflow_rate"]) == 0.25 and not bool(m["skipped"])
    # Fewer than 2000 steps: the recent rate is the mean so far (1 overflow in 4 steps).
    assert float(m["recent_overflow_rate"]) == 0.25
    # The last step was good: no leaf overflowed.
    assert int(m["overflow_leaves"]) == 0 and int(m["first_overflow_leaf"]) == -1
    dtypes = {
        "loss_scale": jnp.float32,
        "overflow": jnp.bool_,
        "skipped": jnp.bool_,
        "stuck": jnp.bool_,
        "unlanded": jnp.bool_,
        "total_steps": jnp.int32,
        "overflow_steps": jnp.int32,
        "skipped_steps": jnp.int32,
        "overflow_rate": jnp.float32,
        "recent_overflow_rate": jnp.float32,
        "overflow_leaves": jnp.int32,
        "first_overflow_leaf": jnp.int32,
    }
    assert set(m) == set(dtypes)
    for k, v in m.items():
        assert v.dtype == dtypes[k] and v.shape == (), k
    # A bare LossScaleState (no transformation, no record): the attribution keys are absent.
    assert set(lsj.metrics(state.loss_scale)) == set(dtypes) - {
        "overflow_leaves",
        "first_overflow_leaf",
    }


def test_scale_loss_dtypes_and_errors():
    state = lsj.StaticScale(8.0).init()
    assert lsj.scale_loss(jnp.float16(2.0), state).dtype == jnp.float32
    assert float(lsj.scale_loss(jnp.float32(2.0), state)) == 16.0
    with pytest.raises(TypeError, match="floating"):
        lsj.scale_loss(jnp.int32(2), state)
    with pytest.raises(ValueError, match="scalar"):
        lsj.scale_loss(jnp.ones(3), state)
    with pytest.raises(ValueError, match="no LossScaleState"):
        lsj.scale_loss(jnp.float32(1.0), optax.adam(1e-3).init(params_of()))
    two = (state, lsj.StaticScale(2.0).init())
    with pytest.raises(ValueError, match="2 LossScaleStates"):
        lsj.get_loss_scale_state(two)


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        ({"inner": "adam"}, TypeError, "inner"),
        ({"policy": 2.0**15}, TypeError, "policy"),
        ({"overflow": "nan"}, ValueError, "overflow"),
        ({"compute_dtype": jnp.int8}, TypeError, "compute_dtype"),
        ({"compute_dtype": "not-a-dtype"}, TypeError, "compute_dtype"),
        ({"axis_name": ()}, ValueError, "axis_name"),
        ({"axis_name": ["i", None]}, TypeError, "axis_name"),
    ],
)
def test_loss_scaling_rejects_bad_arguments(kwargs, exc, words):
    args = {"inner": optax.sgd(0.1), "policy": lsj.DynamicScale()} | kwargs
    inner, policy = args.pop("inner"), args.pop("policy")
    with pytest.raises(exc, match=words):
        lsj.loss_scaling(inner, policy, **args)


# ------------------------------------------------------------------ resumed and switched policies


def test_a_static_policy_continuing_a_dynamic_state_takes_its_own_scale():
    """The first step unscales with the scale its gradients were made with; adjust then
    writes the policy's own scale."""
    params = params_of()
    old = lsj.loss_scaling(optax.sgd(1.0), lsj.DynamicScale(init_scale=2.0**15)).init(params)
    tx = lsj.loss_scaling(optax.sgd(1.0), lsj.StaticScale(8.0))
    step = make_step(tx)
    _, state, updates = step(params, old, grads_like(params, 2.0**15))  # gradient 1, scaled
    np.testing.assert_array_equal(np.asarray(updates["b"]), -1.0)  # unscaled by 2**15
    assert float(state.loss_scale.scale) == 8.0


def test_switch_policy_before_the_next_step():
    params = params_of()
    old_tx = lsj.loss_scaling(optax.adam(1e-2), lsj.DynamicScale(init_scale=2.0**15))
    state = old_tx.init(params)
    for g in (1.0, np.inf, 1.0):  # some history in the counters
        _, state = old_tx.update(grads_like(params, g), state, params)
    new_policy = lsj.StaticScale(8.0)
    switched = lsj.switch_policy(optax.chain(old_tx).init(params), new_policy)
    assert float(lsj.get_loss_scale_state(switched).scale) == 8.0  # nested: a chain state
    switched = jax.jit(lsj.switch_policy, static_argnums=1)(state, new_policy)
    ls = switched.loss_scale
    assert float(lsj.scale_loss(jnp.float32(1.0), switched)) == 8.0  # before any step
    assert int(ls.total_steps) == 3 and int(ls.skipped_steps) == 1  # telemetry kept
    assert int(ls.growth_count) == 0  # the scale moved: counting restarts
    assert_trees_equal(switched.inner_state, state.inner_state)
    assert float(lsj.switch_policy(ls, lsj.NoScale()).scale) == 1.0  # a bare LossScaleState
    # Raising min_scale: the scale is lifted into the new range.
    raised = lsj.switch_policy(state, lsj.DynamicScale(init_scale=2.0**16, min_scale=2.0**16))
    assert float(raised.loss_scale.scale) == 2.0**16
    with pytest.raises(TypeError, match="policy must be a lossscale_jax policy"):
        lsj.switch_policy(state, 8.0)


def test_a_corrupted_scale_in_the_state_is_skipped_then_repaired():
    params = params_of()
    tx = lsj.loss_scaling(optax.adam(1e-2), lsj.DynamicScale(init_scale=8.0, min_scale=2.0))
    step = make_step(tx)
    for bad in (0.0, -8.0, np.nan):
        state = tx.init(params)
        state = state._replace(loss_scale=state.loss_scale.replace(scale=jnp.float32(bad)))
        p, state, _ = step(params, state, grads_like(params, 0.0))
        assert bool(state.loss_scale.last_skipped) and float(state.loss_scale.scale) == 2.0
        assert_trees_equal(p, params)
        assert int(state.inner_state[0].count) == 0
        _, state, _ = step(p, state, grads_like(params, 2.0))
        assert not bool(state.loss_scale.last_skipped)


@pytest.mark.parametrize("fused", [False, True])
def test_integer_gradient_leaf_is_refused_naming_its_path(fused):
    # An int32 gradient can be neither unscaled nor checked: optax.adam would take it scaled
    # (its moment comes back float32, the update 4x too large). Refused while traced, naming
    # the leaf, on both paths; a float0 leaf (jax.grad(..., allow_int=True)) is no value.
    params = {"w": jnp.ones(3), "step": jnp.int32(0)}
    tx = lsj.loss_scaling(optax.adam(0.1), lsj.StaticScale(4.0))
    state = tx.init(params)
    grads = {"w": jnp.full(3, 4.0), "step": jnp.int32(0)}
    if fused:
        step = jax.jit(lambda g, s: lsj.apply_gradients(tx, g, s, params))
    else:
        step = jax.jit(lambda g, s: tx.update(g, s, params))
    with pytest.raises(lsj.errors.GradientDtypeError, match=r"\['step'\] is int32"):
        step(grads, state)
    with pytest.raises(TypeError, match=r"loss_scaling: .*\['step'\] is bool"):
        step({"w": jnp.full(3, 4.0), "step": jnp.bool_(True)}, state)


@pytest.mark.parametrize("fused", [False, True])
def test_inner_state_that_changes_dtype_on_its_first_update(fused):
    # An inner whose state starts int32 and comes back float32 (as optax.adam's moment of an
    # integer leaf did): a skipped step gives the state in the dtype a good one would (a
    # conditional needs both branches alike), with the values it had.
    def init(params):
        return {"acc": jnp.zeros([], jnp.int32)}

    def update(updates, state, params=None):
        return updates, {"acc": state["acc"] + 1.5}

    params = {"w": jnp.ones(3)}
    tx = lsj.loss_scaling(optax.GradientTransformation(init, update), lsj.StaticScale(4.0))
    state = tx.init(params)
    if fused:
        step = jax.jit(lambda g, s: lsj.apply_gradients(tx, g, s, params)[1])
    else:
        step = jax.jit(lambda g, s: tx.update(g, s, params)[1])
    skipped = step({"w": jnp.full(3, jnp.inf)}, state)
    assert bool(skipped.loss_scale.last_skipped)
    acc = skipped.inner_state["acc"]
    assert acc.dtype == jnp.float32 and float(acc) == 0.0
    good = step({"w": jnp.full(3, 4.0)}, state)
    assert good.inner_state["acc"].dtype == jnp.float32 and float(good.inner_state["acc"]) == 1.5
