"""float16 parameters: nothing non-finite ever reaches them from an applied step, and
``lsj.master_weights`` (float32 master copies in the optimizer state) trains them like float32
master weights.

The case users met: a small MLP with float16 parameters under
``optax.adam(1e-3, eps=1e-8)``. eps is 0 in float16 and the second moment underflows, so the
first applied step wrote inf into the parameters; every later step overflowed, the scale fell
to 1 and the loss was nan. Now no such update lands: the step is skipped and reported as
unlanded (not as an overflow of the gradients), and ``on_stuck="error"`` names the leaves and
``lsj.master_weights``. The reference here is the same MLP trained with float32 master
weights and float16 compute (the README's step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import all_finite  # tests/ is on sys.path under pytest

import lossscale_jax as lsj
from lossscale_jax.errors import Float16OptimizerWarning

K = jax.random.split(jax.random.PRNGKey(0), 4)
X = jax.random.normal(K[0], (256, 16))
Y = jnp.tanh(X @ jax.random.normal(K[1], (16, 1)))
P32 = {
    "w1": jax.random.normal(K[2], (16, 32)) * 0.25,
    "b1": jnp.zeros(32),
    "w2": jax.random.normal(K[3], (32, 1)) * 0.18,
    "b2": jnp.zeros(1),
}
P16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), P32)
STEPS = 300


def loss_fn(p, x, y):
    p = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), p)  # compute in float16
    h = jax.nn.relu(x.astype(jnp.float16) @ p["w1"] + p["b1"])
    return jnp.mean(((h @ p["w2"] + p["b2"]).astype(jnp.float32) - y) ** 2)


def adam():
    return optax.adam(1e-3, eps=1e-8)


def train(params, tx, steps=STEPS):
    """``steps`` steps on batches of 32; the losses, and whether params were ever non-finite."""
    state = tx.init(params)

    @jax.jit
    def step(params, state, x, y):
        loss, grads = lsj.value_and_grad(loss_fn, state)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses, finite = [], True
    for i in range(steps):
        rows = slice(32 * (i % 8), 32 * (i % 8) + 32)
        params, state, loss = step(params, state, X[rows], Y[rows])
        finite = finite and all_finite(params)
        losses.append(float(loss))
    return params, state, losses, finite


@pytest.fixture(scope="module")
def reference():
    """float32 master weights, float16 compute: the README's step."""
    return train(P32, lsj.loss_scaling(adam(), lsj.DynamicScale()))


@pytest.mark.slow
def test_float16_params_under_adam_never_get_a_non_finite_value(reference):
    tx = lsj.loss_scaling(adam(), lsj.DynamicScale())
    with pytest.warns(Float16OptimizerWarning, match=r"\['b1'\], \['b2'\], \['w1'\], \['w2'\]"):
        params, state, losses, finite = train(P16, tx)  # its init warns
    assert finite  # before: inf in 110 parameters after the first applied step
    m = lsj.metrics(state)
    # Every update would land inf or nan: every step is skipped as unlanded (stuck: no scale
    # fixes it), none counted as an overflow of the gradients.
    assert int(m["skipped_steps"]) == STEPS and bool(m["stuck"]) and bool(m["unlanded"])
    assert int(m["overflow_steps"]) == 0
    # The leaves named are those the update would have overflowed (not the finite gradients).
    assert lsj.overflowed_leaves(state, params)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(a, b), params, P16)


def test_float16_adam_is_reported_as_unlanded_not_as_gradient_overflow():
    # 30 steps of float16 parameters under optax.adam: every update would land inf or nan.
    # Each step is skipped as unlanded (and stuck: no scale fixes it), not as an overflow of
    # the gradients (they are finite): overflow_rate 0 and the scale stays where it was,
    # where it used to fall to 1 within 15 steps with overflow_rate 1.00.
    tx = lsj.loss_scaling(adam(), lsj.DynamicScale())
    with pytest.warns(Float16OptimizerWarning, match="lsj.master_weights"):
        params, state, _, finite = train(P16, tx, steps=30)
    m = lsj.metrics(state)
    assert finite and int(m["skipped_steps"]) == 30 and int(m["total_steps"]) == 30
    assert bool(m["unlanded"]) and bool(m["stuck"]) and not bool(m["overflow"])
    assert int(m["overflow_steps"]) == 0 and float(m["overflow_rate"]) == 0.0
    assert float(m["recent_overflow_rate"]) == 0.0
    assert float(m["loss_scale"]) == 2.0**15  # DynamicScale's start: nothing moved it
    assert lsj.overflowed_leaves(state, params)  # the leaves whose update would not land
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(a, b), params, P16)


def test_on_stuck_error_names_the_float16_leaves_and_master_weights():
    from jax.experimental import checkify

    tx = lsj.loss_scaling(adam(), lsj.DynamicScale(), on_stuck="error")
    with pytest.warns(Float16OptimizerWarning):
        state = tx.init(P16)

    @jax.jit
    @checkify.checkify
    def step(params, state, x, y):
        _, grads = lsj.value_and_grad(loss_fn, state)(params, x, y)
        return tx.update(grads, state, params)

    err, (_, state) = step(P16, state, X[:32], Y[:32])
    message = err.get()
    assert message is not None and "cannot land the update (step 1)" in message
    assert "['b1'], ['b2'], ['w1'], ['w2']" in message
    assert "lsj.loss_scaling(lsj.master_weights(inner), policy)" in message
    assert "stuck: the gradients overflowed" not in message  # not the scale's message
    # With master copies: it lands, nothing to report.
    masters = lsj.loss_scaling(lsj.master_weights(adam()), lsj.DynamicScale(), on_stuck="error")

    @jax.jit
    @checkify.checkify
    def good(params, state, x, y):
        _, grads = lsj.value_and_grad(loss_fn, state)(params, x, y)
        return masters.update(grads, state, params)

    err, (_, state) = good(P16, masters.init(P16), X[:32], Y[:32])
    assert err.get() is None and not bool(lsj.metrics(state)["skipped"])


@pytest.mark.slow
def test_master_weights_train_float16_params_like_float32_masters(reference):
    _, _, want, _ = reference
    params, state, losses, finite = train(
        P16, lsj.loss_scaling(lsj.master_weights(adam()), lsj.DynamicScale())
    )
    assert finite and int(lsj.metrics(state)["skipped_steps"]) == 0
    assert all(p.dtype == jnp.float16 for p in jax.tree_util.tree_leaves(params))
    # The same float16 forward pass and float32 Adam on masters that round to the same
    # parameters: the losses agree to float16's resolution of the forward pass (2**-10
    # relative per rounding; the largest gap seen is 5e-4 on a loss of 0.2-1.3).
    assert want[-1] < 0.25 * want[0]  # the reference trains
    np.testing.assert_allclose(losses, want, rtol=5e-3, atol=2e-3)
    # The parameters are the masters rounded, bit for bit (Adam's steps are small).
    masters = state.inner_state.master
    for k, p in params.items():
        np.testing.assert_array_equal(np.asarray(p), np.asarray(masters[k].astype(jnp.float16)))


def test_the_updates_land_on_the_rounded_masters():
    # float16 pairs (old, new) over the whole range: optax.apply_updates(p, new - p) lands
    # on new wherever the exponents are within 13 (or either is zero), as the docstring says.
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**16, size=(200_000, 2), dtype=np.uint16)
    old, new = (bits.view(np.float16)[:, i].astype(np.float32) for i in (0, 1))
    keep = np.isfinite(old) & np.isfinite(new)
    old, new = old[keep], new[keep]
    gap = np.abs(np.frexp(old)[1] - np.frexp(new)[1])
    near = (gap <= 13) | (old == 0) | (new == 0)
    p = jnp.asarray(old[near], jnp.float16)
    updates = jnp.asarray(new[near], jnp.float16).astype(jnp.float32) - p.astype(jnp.float32)
    landed = optax.apply_updates({"p": p}, {"p": updates})["p"]
    np.testing.assert_array_equal(np.asarray(landed, np.float32), new[near])
    # bfloat16: within 16.
    bits = rng.integers(0, 2**16, size=(200_000, 2), dtype=np.uint16).astype(np.uint32) << 16
    old, new = (bits.view(np.float32)[:, i] for i in (0, 1))
    # magnitudes whose float32 differences are normal (XLA:CPU flushes subnormals to zero)
    keep = np.all([(2.0**-100 <= np.abs(v)) & (np.abs(v) < 2.0**126) for v in (old, new)], 0)
    old, new = old[keep], new[keep]
    near = np.abs(np.frexp(old)[1] - np.frexp(new)[1]) <= 16
    p = jnp.asarray(old[near].astype(ml_dtypes.bfloat16))
    updates = jnp.asarray(new[near]) - jnp.asarray(old[near])
    landed = optax.apply_updates({"p": p}, {"p": updates})["p"]
    np.testing.assert_array_equal(np.asarray(landed, np.float32), new[near])


def test_master_weights_unscale_into_float32_and_keep_float32_leaves_as_they_are():
    # A scaled gradient of 1 at scale 2**26: 2**-26 unscaled is 0 in float16, not in float32.
    params = {"h": jnp.full(2, 2.0**-10, jnp.float16), "f": jnp.ones(2, jnp.float32)}
    seen = {}

    def spy_update(updates, state, params=None):
        seen.update(updates=updates, params=params)
        return jax.tree_util.tree_map(lambda g: -g, updates), state

    spy = optax.GradientTransformation(lambda p: optax.EmptyState(), spy_update)
    tx = lsj.loss_scaling(lsj.master_weights(spy), lsj.StaticScale(2.0**26))
    state = tx.init(params)
    grads = {"h": jnp.ones(2, jnp.float16), "f": jnp.ones(2, jnp.float32)}
    updates, state = tx.update(grads, state, params)
    assert seen["updates"]["h"].dtype == jnp.float32 and float(seen["updates"]["h"][0]) == 2.0**-26
    assert seen["params"]["h"].dtype == jnp.float32  # the inner runs on the masters
    assert float(state.inner_state.master["h"][0]) == 2.0**-10 - 2.0**-26
    assert state.inner_state.master["f"] is None  # a float32 parameter is its own master
    assert float(updates["f"][0]) == -(2.0**-26)  # the inner's update, as it gave it
    assert float(updates["h"][0]) == 0.0  # 2**-10 - 2**-26 rounds to 2**-10 in float16
    # Without master weights the float16 gradient unscales into float16: 0.
    with pytest.warns(Float16OptimizerWarning):
        plain = lsj.loss_scaling(spy, lsj.StaticScale(2.0**26))
        plain_state = plain.init(params)
    plain.update(grads, plain_state, params)
    assert seen["updates"]["h"].dtype == jnp.float16 and float(seen["updates"]["h"][0]) == 0.0


def test_parameters_changed_outside_take_over_their_masters():
    params = {"w": jnp.array([1.0, 2.0], jnp.float16)}
    tx = lsj.master_weights(optax.sgd(1e-4))
    state = tx.init(params)
    _, state = tx.update({"w": jnp.ones(2, jnp.float32)}, state, params)
    assert state.master["w"].tolist() == pytest.approx([0.9999, 1.9999], abs=1e-7)
    changed = {"w": jnp.array([1.0, 8.0], jnp.float16)}  # e.g. a restored checkpoint
    updates, state = tx.update({"w": jnp.zeros(2, jnp.float32)}, state, changed)
    assert state.master["w"].tolist() == pytest.approx([0.9999, 8.0], abs=1e-7)
    assert np.asarray(optax.apply_updates(changed, updates)["w"]).tolist() == [1.0, 8.0]
    with pytest.raises(ValueError, match="master_weights needs params"):
        tx.update({"w": jnp.zeros(2)}, state)


@pytest.mark.parametrize("front", ["fused", "multi_steps", "layerwise"])
def test_every_front_end_keeps_non_finite_values_out_of_float16_params(front):
    params = {"w": jnp.array([62000.0, 1.0], jnp.float16)}
    grads = {"w": jnp.array([-4096.0, 0.0], jnp.float16)}  # sgd(1.0): 66096 is inf in float16
    with pytest.warns(Float16OptimizerWarning):
        if front == "fused":
            tx = lsj.loss_scaling(optax.sgd(1.0), lsj.StaticScale(1.0))
            state = tx.init(params)
            new, state = lsj.apply_gradients(tx, grads, state, params)
        elif front == "multi_steps":
            tx = lsj.loss_scaling_multi_steps(optax.sgd(1.0), lsj.StaticScale(1.0), 2)
            state = tx.init(params)
            new = params
            for _ in range(2):
                updates, state = tx.update(grads, state, params)
                new = optax.apply_updates(params, updates)
        else:

            def lw_loss(p):  # d loss / d w = grads, through one layer tap
                return jnp.sum(lsj.tap(p["w"], "l0") * grads["w"])

            layers = lsj.layerwise.discover(lw_loss, params)
            policy = lsj.HeadroomScale(init_scale=1.0, min_scale=1.0)
            tx = lsj.layerwise_scaling(optax.sgd(1.0), layers, policy)
            state = tx.init(params)
            scaled = lambda p: lsj.scale_loss(lw_loss(p), state)  # noqa: E731
            _, g, taps = lsj.layerwise.value_and_grad(scaled, layers, state)(params)
            new, state = lsj.apply_gradients(tx, g, state, params, taps=taps)
    assert all_finite(new)
    m = lsj.metrics(state)
    assert bool(m["skipped"]) and bool(m["unlanded"]) and not bool(m["overflow"])
    assert int(m["overflow_steps"]) == 0 and float(m["loss_scale"]) == 1.0  # kept
    assert lsj.overflowed_leaves(state, params) == ["['w']"]


def test_torch_multi_optimizer_keeps_non_finite_values_out_of_float16_params():
    # Per optimizer, as torch decides: the partition whose float16 update would land inf is
    # skipped, the other applies.
    params = {"h": jnp.array([62000.0, 1.0], jnp.float16), "w": jnp.ones(2)}
    with pytest.warns(Float16OptimizerWarning, match=r"\['h'\]"):
        tx = lsj.compat.torch.multi_optimizer(
            {"a": optax.sgd(1.0), "b": optax.sgd(1.0)},
            {"h": "a", "w": "b"},
            lsj.compat.torch.GradScaler(init_scale=1.0),
        )
        state = tx.init(params)
    grads = {"h": jnp.array([-4096.0, 0.0], jnp.float16), "w": jnp.ones(2, jnp.float16)}
    updates, state = tx.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    assert all_finite(new) and new["h"].tolist() == params["h"].tolist()
    assert new["w"].tolist() == [0.0, 0.0]  # the other optimizer stepped
    assert lsj.overflowed_leaves(state, params) == ["['h']"]
    assert bool(lsj.metrics(state)["unlanded"]) and not bool(lsj.metrics(state)["overflow"])
    # The gradients overflow in w's partition and h's update cannot land: both skipped (h
    # for its own landing, although the overflow is w's), the record names w's overflow.
    bad = {**grads, "w": jnp.array([jnp.inf, 1.0], jnp.float16)}
    with pytest.warns(Float16OptimizerWarning):
        fresh = tx.init(params)
    updates, state = tx.update(bad, fresh, params)
    new = optax.apply_updates(params, updates)
    assert all_finite(new) and new["h"].tolist() == params["h"].tolist()
    assert new["w"].tolist() == params["w"].tolist()
    assert lsj.overflowed_leaves(state, params) == ["['w']"]
    assert bool(lsj.metrics(state)["overflow"]) and not bool(lsj.metrics(state)["unlanded"])


def test_an_nnx_model_with_float16_params_trains_through_master_weights():
    model = nnx.Linear(16, 1, param_dtype=jnp.float16, dtype=jnp.float16, rngs=nnx.Rngs(0))
    tx = lsj.loss_scaling(lsj.master_weights(adam()), lsj.DynamicScale())
    opt = lsj.LossScaleOptimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y):
        def loss(m):
            return jnp.mean((m(x.astype(jnp.float16)).astype(jnp.float32) - y) ** 2)

        value, grads = lsj.value_and_grad(loss, opt)(model)
        opt.update(model, grads)
        return value

    first = float(step(model, opt, X[:32], Y[:32]))
    for i in range(60):
        rows = slice(32 * (i % 8), 32 * (i % 8) + 32)
        last = float(step(model, opt, X[rows], Y[rows]))
    assert model.kernel[...].dtype == jnp.float16 and all_finite(nnx.state(model))
    assert last < first
