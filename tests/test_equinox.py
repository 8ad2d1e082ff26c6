"""Equinox models: a skipped step leaves the model, Adam's state and an ``eqx.nn.State`` alone.

The models are real Equinox modules: an ``eqx.nn.MLP`` and a ``Linear -> BatchNorm -> relu
-> Linear`` network with state (``eqx.nn.make_with_state``), both holding ``jax.nn.relu``,
a field that is not an array. The steps are the ones docs/equinox.md shows.

References: plain Optax (``optax.adam`` with ``eqx.apply_updates``) stepping the unscaled
gradients of the good steps only, Equinox's own gradients taken apart, and a plain Python
count of the good steps.
"""

from __future__ import annotations

import io

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (  # tests/ is on sys.path under pytest
    assert_bits_equal,
    assert_step_within_ulps,
    assert_trees_equal,
    programs_round_alike,
)

import lossscale_jax as lsj

SCALE = 2.0**8
F16, F32 = jnp.float16, jnp.float32


class Net(eqx.Module):
    """Linear -> BatchNorm -> relu -> Linear; BatchNorm in float32, the rest in x's dtype."""

    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    head: eqx.nn.Linear
    activation: object

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.linear = eqx.nn.Linear(3, 8, use_bias=False, key=k1)
        self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
        self.head = eqx.nn.Linear(8, 1, key=k2)
        self.activation = jax.nn.relu

    def __call__(self, x, state):
        h = self.linear(x)
        n, state = self.norm(h.astype(F32), state)
        return self.head(self.activation(n).astype(x.dtype)), state


def to_half(tree):
    return jax.tree_util.tree_map(lambda a: a.astype(F16) if eqx.is_inexact_array(a) else a, tree)


def batch(i, poison=False):
    x = jnp.asarray(np.random.default_rng(i).normal(size=(8, 3)), F32)
    y = jnp.sum(x, axis=1, keepdims=True)
    return (x.at[0, 0].set(jnp.inf) if poison else x), y


def make_net():
    net, state = eqx.nn.make_with_state(Net)(jax.random.key(0))
    params, static = eqx.partition(net, eqx.is_array)
    return params, static, state


def net_loss(static, state, x, y):
    """The loss and BatchNorm's new state, as a function of the (float16) parameters."""

    def loss(p):
        batched = jax.vmap(
            eqx.combine(p, static), axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )
        pred, new_state = batched(x.astype(p.head.weight.dtype), state)
        return jnp.mean((pred.astype(F32) - y) ** 2), new_state

    return loss


@eqx.filter_jit
def net_grads(params, static_state, x, y, scale):
    """Gradients of the float16 loss times ``scale``, and the new state."""
    static, state = static_state

    def scaled(p):
        loss, new_state = net_loss(static, state, x, y)(p)
        return loss * scale, new_state

    return eqx.filter_grad(scaled, has_aux=True)(to_half(params))


def make_net_step(tx, static):
    """The page's BatchNorm step: the fused step, the state kept on a skipped step."""
    traces = []

    @eqx.filter_jit
    def step(params, state, opt_state, x, y):
        traces.append(None)

        def scaled(p):
            loss, new_state = net_loss(static, state, x, y)(p)
            return lsj.scale_loss(loss, opt_state), new_state

        grads, new_state = eqx.filter_grad(scaled, has_aux=True)(to_half(params))
        params, opt_state = lsj.apply_gradients(tx, grads, opt_state, params)
        skipped = lsj.metrics(opt_state)["skipped"]
        state = jax.tree_util.tree_map(
            lambda old, new: jnp.where(skipped, old, new), state, new_state
        )
        return params, state, opt_state

    return step, traces


@pytest.mark.slow
def test_injected_overflow_leaves_params_adam_and_the_batchnorm_state():
    params, static, state = make_net()
    tx = lsj.loss_scaling(optax.adam(1e-2), lsj.StaticScale(SCALE))
    step, traces = make_net_step(tx, static)
    params, state, opt_state = step(params, state, tx.init(params), *batch(1))
    x, y = batch(2, poison=True)
    new_params, new_state, new_opt = step(params, state, opt_state, x, y)
    # The forward pass really did write non-finite statistics, which were not kept.
    _, poisoned = net_grads(params, (static, state), x, y, SCALE)
    assert not all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree_util.tree_leaves(poisoned))
    assert bool(lsj.metrics(new_opt)["skipped"])
    assert_bits_equal(new_params, params, "params")
    assert_bits_equal(new_state, state, "BatchNorm state")
    assert_bits_equal(new_opt.inner_state, opt_state.inner_state, "Adam")
    assert new_params.linear.weight.dtype == F32  # the float32 master weights
    step(new_params, new_state, new_opt, *batch(3))
    assert len(traces) == 1  # one compilation for good and skipped steps alike


@pytest.mark.slow
def test_matches_plain_optax_on_good_steps():
    """Reference: optax.adam + eqx.apply_updates on the unscaled gradients of good steps
    (the float16 gradients of the loss times the scale, divided by it in float32)."""
    params, static, state = make_net()
    tx = lsj.loss_scaling(optax.adam(1e-2), lsj.StaticScale(SCALE))
    step, traces = make_net_step(tx, static)
    opt_state = tx.init(params)
    adam = optax.adam(1e-2)
    ref, ref_state, ref_opt = params, state, adam.init(params)
    poison, good = {2, 3, 6}, 0
    for i in range(8):
        x, y = batch(10 + i, poison=i in poison)
        if i not in poison:
            g, ref_state = net_grads(ref, (static, ref_state), x, y, SCALE)
            g = jax.tree_util.tree_map(lambda a: a.astype(F32) / SCALE, g)
            updates, ref_opt = adam.update(g, ref_opt, ref)
            ref = eqx.apply_updates(ref, updates)
            good += 1
        params, state, opt_state = step(params, state, opt_state, x, y)
        m = lsj.metrics(opt_state)
        assert int(m["total_steps"]) - int(m["skipped_steps"]) == good
    # The two programs are compiled apart and their float16 passes may round differently:
    # the runs agree to float16 precision, not to the bit.
    for got, want in [(params, ref), (state, ref_state)]:
        jax.tree_util.tree_map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-5), got, want
        )
    assert int(opt_state.inner_state[0].count) == good  # Adam advanced on good steps only
    assert len(traces) == 1


def mlp():
    return eqx.nn.MLP(3, 1, 16, 2, activation=jax.nn.relu, key=jax.random.key(0))


def mlp_loss(model16, x, y):
    return jnp.mean((jax.vmap(model16)(x.astype(F16)).astype(F32) - y) ** 2)


@eqx.filter_jit
def optax_step(tx, model, opt_state, x, y):
    """The getting-started step: tx.update on eqx.filter(model, eqx.is_array)."""
    scaled = lambda m: lsj.scale_loss(mlp_loss(m, x, y), opt_state)  # noqa: E731
    grads = eqx.filter_grad(scaled)(to_half(model))
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state


@pytest.mark.slow
def test_fused_and_optax_paths_are_bit_identical():
    """The fused step (eqx.partition, lsj.apply_gradients, eqx.combine) and the Optax path.

    Bit for bit on XLA:CPU with the conditional; under a select (a GPU's formulation) the two
    programs may round the update differently (helpers.programs_round_alike): there each step
    from the same state within one float32 ulp.
    """
    tx = lsj.loss_scaling(optax.adam(1e-2), lsj.DynamicScale(init_scale=2.0**14))
    model = mlp()
    params, static = eqx.partition(model, eqx.is_array)
    opt_optax = opt_fused = tx.init(params)

    @eqx.filter_jit
    def fused_step(params, opt_state, x, y):
        scaled = lambda p: lsj.scale_loss(mlp_loss(eqx.combine(p, static), x, y), opt_state)  # noqa: E731
        grads = eqx.filter_grad(scaled)(to_half(params))
        return lsj.apply_gradients(tx, grads, opt_state, params)

    alike = programs_round_alike()
    for i in range(6):
        x, y = batch(20 + i, poison=i == 2)
        before = (eqx.filter(model, eqx.is_array), opt_optax)
        model, opt_optax = optax_step(tx, model, opt_optax, x, y)
        # each step from the same state where the programs may round apart (helpers)
        params, opt_fused = fused_step(*((params, opt_fused) if alike else before), x, y)
        a, b = eqx.filter(model, eqx.is_array), params
        if alike:
            assert_bits_equal(a, b, f"step {i}")
        else:
            assert_step_within_ulps(b, a, before[0], 1, f"step {i}")
        assert_trees_equal(lsj.metrics(opt_optax), lsj.metrics(opt_fused), f"step {i}")
    assert model.activation is eqx.combine(params, static).activation is jax.nn.relu
    assert int(lsj.metrics(opt_fused)["skipped_steps"]) >= 1


@pytest.mark.slow
def test_accumulation_skips_a_window_and_applies_the_mean_of_the_next():
    """Reference: optax.adam on the mean of a window's unscaled gradients, taken apart."""
    k = 4
    tx = lsj.loss_scaling_multi_steps(optax.adam(1e-2), lsj.StaticScale(SCALE), every_k=k)
    model = mlp()
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    start = model
    batches = [batch(30 + i, poison=i == 1) for i in range(2 * k)]
    for x, y in batches[:k]:
        model, opt_state = optax_step(tx, model, opt_state, x, y)
    assert_bits_equal(eqx.filter(model, eqx.is_array), eqx.filter(start, eqx.is_array))
    assert int(lsj.metrics(opt_state)["skipped_steps"]) == 1
    for x, y in batches[k:]:
        model, opt_state = optax_step(tx, model, opt_state, x, y)

    @eqx.filter_jit
    def grad(model, x, y):
        g = eqx.filter_grad(lambda m: mlp_loss(m, x, y) * SCALE)(to_half(model))
        return jax.tree_util.tree_map(lambda a: a.astype(F32) / SCALE, g)

    grads = [grad(start, x, y) for x, y in batches[k:]]
    mean = jax.tree_util.tree_map(lambda *g: sum(g) / k, *grads)
    adam = optax.adam(1e-2)
    params = eqx.filter(start, eqx.is_array)
    updates, _ = adam.update(mean, adam.init(params), params)
    want = eqx.apply_updates(params, updates)
    # Adam's first step is lr * sign(g) up to eps: the sum's rounding barely shows.
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        eqx.filter(model, eqx.is_array),
        want,
    )
    m = lsj.metrics(opt_state)
    assert (int(m["total_steps"]), int(m["skipped_steps"])) == (2, 1)


@pytest.mark.slow
def test_checkpoint_round_trip_with_tree_serialise_leaves():
    """Save mid-run, restore into a fresh template, continue: bit-identical to not stopping."""
    params, static, state = make_net()
    tx = lsj.loss_scaling(
        optax.adam(1e-2), lsj.DynamicScale(init_scale=2.0**12, growth_interval=10)
    )
    step, _ = make_net_step(tx, static)
    carry = (params, state, tx.init(params))
    for i in range(5):
        carry = step(*carry, *batch(40 + i, poison=i == 1))
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, carry)
    buf.seek(0)
    fresh_params, _, fresh_state = make_net()
    template = (fresh_params, fresh_state, tx.init(fresh_params))
    restored = eqx.tree_deserialise_leaves(buf, template)
    assert_bits_equal(restored, carry, "restored")
    restored_scale = lsj.get_loss_scale_state(restored[2])
    assert float(restored_scale.scale) == 2.0**11  # backed off once, then 3 good steps
    assert (int(restored_scale.growth_count), int(restored_scale.skipped_steps)) == (3, 1)
    for i in range(3):
        x, y = batch(50 + i)
        carry, restored = step(*carry, x, y), step(*restored, x, y)
    assert_bits_equal(restored, carry, "continued")
