"""The right wirings never see the wiring check: the patterns a training loop is written in
(remat, a custom_vjp loss, accumulation in a loop, per-example gradients, gradient penalties,
two models with a state each, NNX, Linen, Equinox, pmap, shard_map, sharded jit, scanned
remat layers in plain JAX, NNX and Linen, a cond in the loss, a vjp seeded with the scale, a
scaled loss guarded by a where and a max, clipping at a scaled threshold, a scaled loss
logged beside value_and_grad), each traced with warnings as errors (the suite's setting) and
each checked to train
right: the update of SGD(0.1) is -0.1 times the gradient of the plain loss, taken by
``jax.grad`` apart from the step (the scales are powers of two and the loss is float32, so
scaling and unscaling are exact up to the float32 rounding of the sums).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lossscale_jax as lsj

K = jax.random.split(jax.random.PRNGKey(0), 4)
X = jax.random.normal(K[0], (8, 3))
Y = jax.random.normal(K[1], (8, 2))
PARAMS = {"w": jax.random.normal(K[2], (3, 2)) * 0.5, "b": jnp.zeros(2)}
LR = 0.1
RTOL = 1e-5  # float32 sums, summed in another order by the wirings that batch or loop


def loss_fn(p, x=X, y=Y):
    return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)


def _sgd(policy=None):
    return lsj.loss_scaling(optax.sgd(LR), policy or lsj.DynamicScale(init_scale=2.0**10))


def _expect_sgd(updates, grads):
    """``updates`` are SGD's of the plain gradients ``grads``."""
    for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]:
        g = functools.reduce(lambda t, k: t[k.key], path, grads)
        np.testing.assert_allclose(np.asarray(u), -LR * np.asarray(g), rtol=RTOL, atol=1e-7)


PLAIN = jax.grad(loss_fn)(PARAMS)


def _update_with(grads_fn, tx=None):
    """One jitted step: ``grads_fn(params, opt_state)``'s gradients given to ``update``."""
    tx = tx or _sgd()

    @jax.jit
    def step(params, opt_state):
        return tx.update(grads_fn(params, opt_state), opt_state, params)

    updates, state = step(PARAMS, tx.init(PARAMS))
    assert not bool(lsj.metrics(state)["skipped"])
    return updates


def test_remat():
    def grads(p, s):
        return jax.grad(lambda q: lsj.scale_loss(jax.checkpoint(loss_fn)(q), s))(p)

    _expect_sgd(_update_with(grads), PLAIN)


def test_a_custom_vjp_chunked_cross_entropy():
    # The memory-saving loss of large vocabularies: logits in chunks, the backward pass
    # written by hand (softmax - onehot, per chunk).
    labels = jnp.array([0, 1, 1, 0, 1, 0, 0, 1])

    @jax.custom_vjp
    def chunked_ce(logits, labels):
        return _ce(logits, labels)

    def _ce(logits, labels):
        chunks = logits.reshape(4, 2, 2)
        lse = jax.vmap(lambda c: jax.nn.logsumexp(c, axis=-1))(chunks).reshape(-1)
        picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
        return jnp.mean(lse - picked)

    def fwd(logits, labels):
        return _ce(logits, labels), (logits, labels)

    def bwd(res, ct):
        logits, labels = res
        chunks = logits.reshape(4, 2, 2)
        soft = jax.vmap(lambda c: jax.nn.softmax(c, axis=-1))(chunks).reshape(logits.shape)
        onehot = jax.nn.one_hot(labels, logits.shape[-1])
        return ct * (soft - onehot) / logits.shape[0], None

    chunked_ce.defvjp(fwd, bwd)

    def ce_loss(p):
        return chunked_ce(X @ p["w"] + p["b"], labels)

    def grads(p, s):
        return jax.grad(lambda q: lsj.scale_loss(ce_loss(q), s))(p)

    _expect_sgd(_update_with(grads), jax.grad(ce_loss)(PARAMS))


def _micro_batches():
    return X.reshape(4, 2, 3), Y.reshape(4, 2, 2)


def test_accumulation_in_a_scan_and_a_fori_loop():
    xs, ys = _micro_batches()
    want = jax.tree_util.tree_map(
        lambda *g: sum(g) / 4,
        *[jax.grad(loss_fn)(PARAMS, x, y) for x, y in zip(xs, ys, strict=True)],
    )

    def scanned(p, s):
        def body(acc, xy):
            g = jax.grad(lambda q: lsj.scale_loss(loss_fn(q, *xy), s))(p)
            return jax.tree_util.tree_map(jnp.add, acc, g), None

        acc, _ = jax.lax.scan(body, jax.tree_util.tree_map(jnp.zeros_like, p), (xs, ys))
        return jax.tree_util.tree_map(lambda a: a / 4, acc)

    def looped(p, s):
        def body(i, acc):
            g = jax.grad(lambda q: lsj.scale_loss(loss_fn(q, xs[i], ys[i]), s))(p)
            return jax.tree_util.tree_map(jnp.add, acc, g)

        acc = jax.lax.fori_loop(0, 4, body, jax.tree_util.tree_map(jnp.zeros_like, p))
        return jax.tree_util.tree_map(lambda a: a / 4, acc)

    _expect_sgd(_update_with(scanned), want)
    _expect_sgd(_update_with(looped), want)


def test_per_example_gradients_under_vmap():
    def grads(p, s):
        per = jax.vmap(
            jax.grad(lambda q, x, y: lsj.scale_loss(loss_fn(q, x[None], y[None]), s)),
            in_axes=(None, 0, 0),
        )(p, X, Y)
        return jax.tree_util.tree_map(lambda g: jnp.mean(g, axis=0), per)

    _expect_sgd(_update_with(grads), PLAIN)


def test_a_gradient_penalty_grad_of_grad():
    # WGAN-GP's term: the norm of the gradient with respect to the input, differentiated again.
    def penalized(p):
        gx = jax.grad(lambda x: jnp.sum(jnp.tanh(x @ p["w"] + p["b"])))(X)
        return loss_fn(p) + 0.1 * jnp.mean((jnp.sqrt(jnp.sum(gx**2, axis=1)) - 1.0) ** 2)

    def grads(p, s):
        return jax.grad(lambda q: lsj.scale_loss(penalized(q), s))(p)

    _expect_sgd(_update_with(grads), jax.grad(penalized)(PARAMS))


def test_a_gan_with_a_state_per_model():
    g_params = {"w": jnp.full((2, 3), 0.3)}
    d_params = {"w": jnp.full((3, 1), 0.2)}
    g_tx = _sgd(lsj.DynamicScale(init_scale=2.0**12))
    d_tx = _sgd(lsj.DynamicScale(init_scale=2.0**4))

    def d_loss(d, g):
        fake = jnp.tanh(Y @ g["w"])
        return jnp.mean(jax.nn.softplus(-(X @ d["w"]))) + jnp.mean(jax.nn.softplus(fake @ d["w"]))

    def g_loss(g, d):
        return jnp.mean(jax.nn.softplus(-(jnp.tanh(Y @ g["w"]) @ d["w"])))

    @jax.jit
    def step(g, d, gs, ds):
        d_grads = jax.grad(lambda q: lsj.scale_loss(d_loss(q, g), ds))(d)
        g_grads = jax.grad(lambda q: lsj.scale_loss(g_loss(q, d), gs))(g)
        d_up, ds = d_tx.update(d_grads, ds, d)
        g_up, gs = g_tx.update(g_grads, gs, g)
        return d_up, g_up

    d_up, g_up = step(g_params, d_params, g_tx.init(g_params), d_tx.init(d_params))
    _expect_sgd(d_up, jax.grad(d_loss)(d_params, g_params))
    _expect_sgd(g_up, jax.grad(g_loss)(g_params, d_params))


def test_nnx_jit_with_a_loss_scale_optimizer():
    from flax import nnx

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    before = jax.tree_util.tree_map(jnp.copy, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    opt = lsj.LossScaleOptimizer(model, _sgd(), wrt=nnx.Param)

    def mse(m):
        return jnp.mean((m(X) - Y) ** 2)

    want = nnx.grad(mse)(model)

    @nnx.jit
    def step(model, opt):
        _, grads = lsj.value_and_grad(mse, opt)(model)
        opt.update(model, grads)

    step(model, opt)
    after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    moved = jax.tree_util.tree_map(lambda a, b: a - b, after, before)
    _expect_sgd(moved, nnx.to_pure_dict(want))


def test_linen_train_state():
    from flax import linen as nn

    model = nn.Dense(2)
    variables = model.init(jax.random.PRNGKey(1), X)
    state = lsj.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=_sgd())

    def mse(params):
        return jnp.mean((state.apply_fn({"params": params}, X) - Y) ** 2)

    @jax.jit
    def step(state):
        _, grads = lsj.value_and_grad(mse, state.opt_state)(state.params)
        return state.apply_gradients(grads=grads)

    new = step(state)
    moved = jax.tree_util.tree_map(lambda a, b: a - b, new.params, state.params)
    _expect_sgd(moved, jax.grad(mse)(state.params))
    assert int(new.step) == 1


def test_equinox_filter_jit():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.Linear(3, 2, key=K[3])
    tx = _sgd()
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    def mse(m):
        return jnp.mean((jax.vmap(m)(X) - Y) ** 2)

    @eqx.filter_jit
    def step(model, opt_state):
        grads = eqx.filter_grad(lambda m: lsj.scale_loss(mse(m), opt_state))(model)
        return tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))

    updates, _ = step(model, opt_state)
    want = eqx.filter_grad(mse)(model)
    np.testing.assert_allclose(updates.weight, -LR * want.weight, rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(updates.bias, -LR * want.bias, rtol=RTOL, atol=1e-7)


@pytest.mark.multidevice(8)
def test_pmap_and_shard_map_and_sharded_jit():
    n = 8
    tx = lsj.loss_scaling(optax.sgd(LR), lsj.DynamicScale(init_scale=2.0**10), axis_name="b")
    state = tx.init(PARAMS)

    def local(p, s, x, y):
        g = jax.grad(lambda q: lsj.scale_loss(loss_fn(q, x, y), s))(p)
        return tx.update(jax.lax.pmean(g, "b"), s, p)[0]

    xs, ys = X.reshape(n, 1, 3), Y.reshape(n, 1, 2)
    rep = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), (PARAMS, state))
    pm = jax.pmap(local, axis_name="b")(*rep, xs, ys)
    _expect_sgd(jax.tree_util.tree_map(lambda u: u[0], pm), PLAIN)

    mesh = jax.make_mesh((n,), ("b",))
    batch = NamedSharding(mesh, P("b"))
    xs, ys = jax.device_put(xs, batch), jax.device_put(ys, batch)
    sm = jax.jit(
        jax.shard_map(
            # each device's own gradients: parameters cast to varying (docs/data_parallel.md)
            lambda p, s, x, y: local(jax.lax.pcast(p, "b", to="varying"), s, x[0], y[0]),
            mesh=mesh,
            in_specs=(P(), P(), P("b"), P("b")),
            out_specs=P(),
        )
    )(PARAMS, state, xs, ys)
    _expect_sgd(sm, PLAIN)

    plain = _sgd()  # sharded jit: XLA reduces, no axis_name
    auto = jax.make_mesh((n,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
    x_sh, y_sh = (jax.device_put(a, NamedSharding(auto, P("b"))) for a in (X, Y))

    @jax.jit
    def sharded(p, s, x, y):
        g = jax.grad(lambda q: lsj.scale_loss(loss_fn(q, x, y), s))(p)
        return plain.update(g, s, p)[0]

    _expect_sgd(sharded(PARAMS, plain.init(PARAMS), x_sh, y_sh), PLAIN)


def test_scanned_layers_with_remat():
    layers = {"w": jnp.stack([jnp.eye(3) * 0.9, jnp.eye(3) * 1.1, jnp.eye(3) * 0.8])}

    def deep(p):
        def layer(h, w):
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(jax.checkpoint(layer), X, p["w"])
        return jnp.mean((h[:, :2] - Y) ** 2)

    def grads(p, s):
        return jax.grad(lambda q: lsj.scale_loss(deep(q), s))(p)

    tx = _sgd()

    @jax.jit
    def step(params, opt_state):
        return tx.update(grads(params, opt_state), opt_state, params)

    updates, _ = step(layers, tx.init(layers))
    _expect_sgd(updates, jax.grad(deep)(layers))


def test_scaled_gradients_clipped_at_a_scaled_threshold():
    # Clipping the scaled gradients at max_norm * scale is clipping the unscaled ones at
    # max_norm: right (the threshold reads the scale after a backward pass that carries it).
    max_norm = 0.01

    def grads(p, s):
        scale = lsj.get_loss_scale_state(s).scale
        g = jax.grad(lambda q: lsj.scale_loss(loss_fn(q), s))(p)
        return optax.clip_by_global_norm(max_norm * scale).update(g, optax.EmptyState())[0]

    want = optax.clip_by_global_norm(max_norm).update(PLAIN, optax.EmptyState())[0]
    _expect_sgd(_update_with(grads), want)


def test_value_and_grad_with_aux_and_a_logged_scaled_loss():
    def grads(p, s):
        (loss, aux), g = lsj.value_and_grad(lambda q: (loss_fn(q), 2.0), s, has_aux=True)(p)
        logged = lsj.scale_loss(loss, s)  # the scaled loss of the same step, logged
        return jax.tree_util.tree_map(lambda a: a + 0.0 * logged * aux, g)

    _expect_sgd(_update_with(grads), PLAIN)


def test_a_scaled_loss_guarded_by_a_where_and_a_max():
    # Operations after scale_loss whose backward pass reads a comparison of the scaled loss
    # (a select's predicate): a bool, no second multiplication by the scale.
    def grads(p, s):
        def guarded(q):
            scaled = lsj.scale_loss(loss_fn(q), s)
            return jnp.maximum(jnp.where(jnp.isfinite(scaled), scaled, 0.0), 0.0)

        return jax.grad(guarded)(p)

    _expect_sgd(_update_with(grads), PLAIN)


def test_a_cond_in_the_loss_and_a_vjp_seeded_with_the_scale():
    def branchy(p):
        h = jax.lax.cond(True, lambda: jnp.tanh(X @ p["w"] + p["b"]), lambda: X @ p["w"])
        return jnp.mean((h - Y) ** 2)

    def with_cond(p, s):
        return jax.grad(lambda q: lsj.scale_loss(branchy(q), s))(p)

    def seeded(p, s):  # the scale as the backward pass's seed: loss * scale, differentiated
        _, pull = jax.vjp(loss_fn, p)
        return pull(lsj.get_loss_scale_state(s).scale)[0]

    _expect_sgd(_update_with(with_cond), jax.grad(branchy)(PARAMS))
    _expect_sgd(_update_with(seeded), PLAIN)


def test_scanned_remat_layers_in_nnx_and_linen():
    from flax import linen as nn
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 3, rngs=rngs)

        def __call__(self, x):
            return jnp.tanh(self.lin(x))

    @nnx.vmap(in_axes=0, out_axes=0)
    def blocks(key):
        return Block(nnx.Rngs(key))

    class Deep(nnx.Module):
        def __init__(self):
            self.blocks = blocks(jax.random.split(K[3], 3))

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            @nnx.remat
            def body(h, block):
                return block(h)

            return body(x, self.blocks)

    def mse(m):
        return jnp.mean((m(X)[:, :2] - Y) ** 2)

    model = Deep()
    want = nnx.to_pure_dict(nnx.grad(mse)(model))
    before = jax.tree_util.tree_map(jnp.copy, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    opt = lsj.LossScaleOptimizer(model, _sgd(), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        opt.update(model, lsj.value_and_grad(mse, opt)(model)[1])

    step(model, opt)
    after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    _expect_sgd(jax.tree_util.tree_map(lambda a, b: a - b, after, before), want)

    class Cell(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return jnp.tanh(nn.Dense(3)(h)), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(
                nn.remat(Cell), variable_axes={"params": 0}, split_rngs={"params": True}, length=3
            )
            return scan()(x, None)[0]

    stack = Stack()
    state = lsj.TrainState.create(
        apply_fn=stack.apply, params=stack.init(K[3], X)["params"], tx=_sgd()
    )

    def linen_mse(params):
        return jnp.mean((state.apply_fn({"params": params}, X)[:, :2] - Y) ** 2)

    new = jax.jit(
        lambda s: s.apply_gradients(grads=lsj.value_and_grad(linen_mse, s.opt_state)(s.params)[1])
    )(state)
    moved = jax.tree_util.tree_map(lambda a, b: a - b, new.params, state.params)
    _expect_sgd(moved, jax.grad(linen_mse)(state.params))
