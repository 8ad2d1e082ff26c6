"""Flax train states: a skipped step leaves step, params and batch_stats alone.

References: Flax's own ``train_state.TrainState`` (and ``nnx.Optimizer``) stepping the
same Optax optimizer on the unscaled gradients of the good steps only, and a plain Python
count of the good steps.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from helpers import assert_trees_equal, programs_round_alike  # tests/ is on sys.path

import lossscale_jax as lsj

SCALE = 2.0**8
F16, F32 = jnp.float16, jnp.float32


class Net(nn.Module):
    """Dense -> BatchNorm -> Dense, float16 compute on float32 master weights."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4, dtype=F16, param_dtype=F32)(x)
        x = nn.BatchNorm(use_running_average=False, dtype=F16, param_dtype=F32)(x)
        return nn.Dense(1, dtype=F16, param_dtype=F32)(x)


def batch(i, poison=False):
    x = jnp.asarray(np.random.default_rng(i).normal(size=(8, 3)), F32)
    y = jnp.sum(x, axis=1, keepdims=True)
    return (x * jnp.inf if poison else x), y


def make_state(**kwargs):
    model = Net()
    variables = model.init(jax.random.key(0), batch(0)[0])
    tx = lsj.loss_scaling(optax.adam(1e-2), lsj.StaticScale(SCALE))
    return lsj.TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=tx,
        batch_stats=variables["batch_stats"],
        **kwargs,
    )


@functools.partial(jax.jit, static_argnames="scale_loss")
def grads_and_stats(state, x, y, scale_loss=True):
    def loss_fn(params):
        out, upd = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats}, x, mutable=["batch_stats"]
        )
        loss = jnp.mean((out.astype(F32) - y) ** 2)
        if scale_loss:
            loss = lsj.scale_loss(loss, state.opt_state)
        return loss, upd["batch_stats"]

    return jax.grad(loss_fn, has_aux=True)(state.params)


def make_step():
    traces = []

    @jax.jit
    def step(state, x, y):
        traces.append(None)
        grads, stats = grads_and_stats(state, x, y)
        return state.apply_gradients(grads=grads, batch_stats=stats)

    return step, traces


def test_injected_overflow_leaves_step_params_and_batch_stats():
    step, traces = make_step()
    state = step(make_state(), *batch(1))  # one good step first
    assert int(state.step) == 1 and state.step.dtype == jnp.int32
    x, y = batch(2, poison=True)
    new = step(state, x, y)
    # The forward pass really did produce non-finite statistics, which were discarded.
    _, poisoned = grads_and_stats(state, x, y)
    assert not all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree_util.tree_leaves(poisoned))
    assert bool(lsj.get_loss_scale_state(new.opt_state).last_skipped)
    assert int(new.step) == 1
    assert new.step.dtype == jnp.int32
    assert_trees_equal(new.batch_stats, state.batch_stats)
    assert_trees_equal(new.params, state.params)
    assert_trees_equal(new.opt_state.inner_state, state.opt_state.inner_state)
    new = step(new, *batch(3))
    assert int(new.step) == 2
    assert len(traces) == 1  # one compilation for good and skipped steps alike


@pytest.mark.slow
def test_matches_flax_train_state_on_good_steps():
    """Reference: Flax's TrainState + optax.adam on the unscaled grads of good steps."""
    step, traces = make_step()
    state = make_state()
    ref = train_state.TrainState.create(
        apply_fn=state.apply_fn, params=state.params, tx=optax.adam(1e-2)
    )
    ref_stats = state.batch_stats
    poison = {2, 3, 6}
    good = 0
    for i in range(8):
        x, y = batch(10 + i, poison=i in poison)
        if i not in poison:
            ref_in = state.replace(params=ref.params, batch_stats=ref_stats)
            g, ref_stats = grads_and_stats(ref_in, x, y, scale_loss=False)
            ref = ref.apply_gradients(grads=g)
            good += 1
        state = step(state, x, y)
        assert int(state.step) == good == int(ref.step)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-5),
        state.params,
        ref.params,
    )
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-5),
        state.batch_stats,
        ref_stats,
    )
    assert int(lsj.metrics(state.opt_state)["skipped_steps"]) == len(poison)
    assert len(traces) == 1


@pytest.mark.slow
def test_fused_and_optax_paths_are_bit_identical():
    """A bare loss_scaling takes the fused step; wrapped in optax.chain, the Optax path.

    Bit for bit on XLA:CPU with the conditional (the fused step adds the same rounded update
    the Optax path materialises). Each whole step is compiled on its own, the float16 backward
    included, and a select (a GPU's formulation) fuses the update differently in the two
    (XLA:GPU was measured 1 float32 ulp apart on one entry): there the paths agree to 2 float32
    ulps over the run.
    """
    step, traces = make_step()
    fused = make_state()
    optax_path = fused.replace(tx=optax.chain(fused.tx), opt_state=(fused.opt_state,))
    grads = jax.tree_util.tree_map(jnp.zeros_like, fused.params)
    lsj.apply_gradients(fused.tx, grads, fused.opt_state, fused.params)  # the fused step runs it
    with pytest.raises(TypeError, match="Optax path"):
        lsj.apply_gradients(optax_path.tx, grads, optax_path.opt_state, optax_path.params)
    for i in range(5):
        x, y = batch(20 + i, poison=i == 2)
        fused, optax_path = step(fused, x, y), step(optax_path, x, y)
        if programs_round_alike():  # XLA:CPU with the conditional (helpers)
            assert_trees_equal(fused.params, optax_path.params)
            assert_trees_equal(fused.batch_stats, optax_path.batch_stats)
        else:
            for a, b in [
                (fused.params, optax_path.params),
                (fused.batch_stats, optax_path.batch_stats),
            ]:
                jax.tree_util.tree_map(
                    lambda a, b: np.testing.assert_array_max_ulp(
                        np.asarray(a), np.asarray(b), maxulp=2
                    ),
                    a,
                    b,
                )
        assert int(fused.step) == int(optax_path.step)
    assert int(fused.step) == 4
    assert len(traces) == 2  # one per optimizer structure


def test_count_skipped_steps_option():
    step, _ = make_step()
    state = make_state(count_skipped_steps=True)
    state = step(step(state, *batch(1)), *batch(2, poison=True))
    assert int(state.step) == 2
    assert int(lsj.metrics(state.opt_state)["skipped_steps"]) == 1


def test_no_rollback_option_keeps_forward_pass_stats():
    step, _ = make_step()
    state = make_state(rollback_on_skip=False)
    x, y = batch(2, poison=True)
    _, fresh = grads_and_stats(state, x, y)
    new = step(state, x, y)
    assert int(new.step) == 0
    assert_trees_equal(new.batch_stats, fresh)  # NaN-equal: the overflowed statistics


def test_create_validates():
    model = nn.Dense(1)
    params = model.init(jax.random.key(0), jnp.ones((1, 2)))["params"]
    with pytest.raises(ValueError, match="loss_scaling"):
        lsj.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.NoScale())
    with pytest.raises(TypeError, match="count_skipped_steps"):
        lsj.TrainState.create(apply_fn=model.apply, params=params, tx=tx, count_skipped_steps=1)
    state = lsj.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    grads = jax.tree_util.tree_map(jnp.zeros_like, params)
    with pytest.raises(ValueError, match="batch_stats"):
        state.apply_gradients(grads=grads, batch_stats={"mean": jnp.zeros(1)})


@pytest.mark.slow
def test_accumulation_counts_windows_and_never_keeps_bad_statistics():
    """The reported case: loss_scaling_multi_steps(k=4), inf in micro-batch 1 of 8.

    step after each micro-batch: 0 0 0 0 | 0 0 0 1 (the first window is skipped, the second
    applied); batch_stats: kept from micro-batch 0, frozen from micro-batch 1 to the end of
    the bad window, then updated again by the next window's forward passes.
    """
    model = Net()
    variables = model.init(jax.random.key(0), batch(0)[0])
    tx = lsj.loss_scaling_multi_steps(optax.adam(1e-2), lsj.DynamicScale(init_scale=2.0**10), 4)
    state = lsj.TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=tx,
        batch_stats=variables["batch_stats"],
    )
    counting = state.replace(count_skipped_steps=True)
    step, traces = make_step()
    steps, counted, stats = [], [], []
    for i in range(8):
        x, y = batch(10 + i, poison=(i == 1))
        state, counting = step(state, x, y), step(counting, x, y)
        steps.append(int(state.step))
        counted.append(int(counting.step))
        stats.append(state.batch_stats)
        leaves = jax.tree_util.tree_leaves(state.batch_stats)
        assert all(bool(jnp.all(jnp.isfinite(v))) for v in leaves), i
    assert steps == [0, 0, 0, 0, 0, 0, 0, 1]
    assert counted == [0, 0, 0, 1, 1, 1, 1, 2]  # windows, the skipped one included
    for i in (1, 2, 3):
        assert_trees_equal(stats[i], stats[0])
    assert not bool(
        jnp.all(jax.tree_util.tree_leaves(stats[4])[0] == jax.tree_util.tree_leaves(stats[3])[0])
    )
    ls = lsj.get_loss_scale_state(state.opt_state)
    assert int(ls.total_steps) == 2 and int(ls.skipped_steps) == 1
    assert len(traces) == 2  # one compilation per TrainState configuration, 8 steps each


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(3, 4, dtype=F16, param_dtype=F32, rngs=rngs)
        self.bn = nnx.BatchNorm(4, dtype=F16, param_dtype=F32, rngs=rngs)
        self.out = nnx.Linear(4, 1, dtype=F16, param_dtype=F32, rngs=rngs)

    def __call__(self, x):
        return self.out(self.bn(self.dense(x)))


def nnx_step_fn(traces):
    @nnx.jit
    def step(model, opt, x, y):
        traces.append(None)
        before = opt.snapshot(model)

        def loss_fn(model):
            loss = jnp.mean((model(x).astype(F32) - y) ** 2)
            return lsj.scale_loss(loss, nnx.as_pure(opt.opt_state))

        opt.update(model, nnx.grad(loss_fn)(model), rollback=before)

    return step


@pytest.mark.slow
def test_nnx_optimizer_skips_and_rolls_back():
    traces = []
    step = nnx_step_fn(traces)
    model = NnxNet(nnx.Rngs(0))
    tx = lsj.loss_scaling(optax.adam(1e-2), lsj.StaticScale(SCALE))
    opt = lsj.LossScaleOptimizer(model, tx, wrt=nnx.Param)
    step(model, opt, *batch(1))
    assert int(opt.step[...]) == 1
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    stats = nnx.as_pure(nnx.state(model, nnx.BatchStat))
    step(model, opt, *batch(2, poison=True))
    assert bool(lsj.metrics(nnx.as_pure(opt.opt_state))["skipped"])
    assert int(opt.step[...]) == 1
    assert_trees_equal(nnx.as_pure(nnx.state(model, nnx.Param)), params)
    assert_trees_equal(nnx.as_pure(nnx.state(model, nnx.BatchStat)), stats)
    step(model, opt, *batch(3))
    assert int(opt.step[...]) == 2
    assert len(traces) == 1

    # Reference: nnx.Optimizer on the unscaled gradients of the two good steps.
    ref_model = NnxNet(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref_model, optax.adam(1e-2), wrt=nnx.Param)
    for i in (1, 3):
        x, y = batch(i)
        g = nnx.grad(lambda m: jnp.mean((m(x).astype(F32) - y) ** 2))(ref_model)  # noqa: B023
        ref_opt.update(ref_model, g)

    def close(path, a, b):
        if jax.tree_util.keystr(path) == "['dense']['bias']":
            # It feeds the BatchNorm, which takes the batch mean out: its true gradient is 0
            # and the computed one rounding noise, which Adam turns into steps of up to lr
            # either way (XLA:GPU's noise differs from the reference's). Two good steps: each
            # run is within 2 lr of the start, so the two within 4 lr of each other.
            np.testing.assert_array_less(np.abs(np.asarray(a) - np.asarray(b)), 4 * 1e-2 + 1e-6)
        else:
            np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-5)

    jax.tree_util.tree_map_with_path(
        close, nnx.as_pure(nnx.state(model)), nnx.as_pure(nnx.state(ref_model))
    )


def test_nnx_count_skipped_and_validation():
    model = NnxNet(nnx.Rngs(0))
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.StaticScale(SCALE))
    opt = lsj.LossScaleOptimizer(model, tx, wrt=nnx.Param, count_skipped_steps=True)
    nnx_step_fn([])(model, opt, *batch(2, poison=True))
    assert int(opt.step[...]) == 1
    with pytest.raises(ValueError, match="loss_scaling"):
        lsj.LossScaleOptimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(TypeError, match="count_skipped_steps"):
        lsj.LossScaleOptimizer(model, tx, wrt=nnx.Param, count_skipped_steps="no")
