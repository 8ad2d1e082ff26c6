"""``lsj.value_and_grad`` and ``lsj.unscaled_global_norm``: the scaled gradients in one call.

The reference is ``jax.value_and_grad`` of the loss without scaling: the gradients come back
multiplied by the scale (a power of two: exactly, for float32), the value as the loss
function returned it, and the norm is that of the plain gradients.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import lossscale_jax as lsj

PARAMS = {"w": jnp.arange(6.0).reshape(2, 3) / 10, "b": jnp.ones(3)}
X = jnp.arange(8.0).reshape(4, 2) / 4
SCALE = 2.0**10


def loss_fn(p, x, *, power=2):
    out = x @ p["w"] + p["b"]
    return jnp.mean(out**power), {"max": jnp.max(out)}


def state():
    return lsj.loss_scaling(optax.sgd(0.1), lsj.StaticScale(SCALE)).init(PARAMS)


def test_value_and_grad_is_the_scaled_loss_s_and_the_value_is_the_loss():
    (loss, aux), grads = lsj.value_and_grad(loss_fn, state(), has_aux=True)(PARAMS, X, power=2)
    (want_loss, want_aux), want = jax.value_and_grad(loss_fn, has_aux=True)(PARAMS, X)
    assert loss == want_loss and aux["max"] == want_aux["max"]
    for k in want:  # times 2**10, exact in float32
        np.testing.assert_array_equal(np.asarray(grads[k]), np.asarray(want[k]) * SCALE)
    norm = lsj.unscaled_global_norm(grads, state())
    plain = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in want.values()))
    np.testing.assert_allclose(float(norm), plain, rtol=1e-6)


def test_argnums_and_signature_follow_jax_and_the_loss_function():
    fun = lsj.value_and_grad(lambda p, x: loss_fn(p, x)[0], state(), argnums=(0, 1))
    _, (gp, gx) = fun(PARAMS, X)
    assert gx.shape == X.shape and set(gp) == {"w", "b"}
    assert inspect.signature(lsj.value_and_grad(loss_fn, state())) == inspect.signature(loss_fn)


def test_a_float16_loss_comes_back_in_float16_and_an_overflow_shows_in_the_norm():
    p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), PARAMS)
    big = lsj.loss_scaling(optax.sgd(0.1), lsj.StaticScale(2.0**24)).init(PARAMS)
    x16 = X.astype(jnp.float16)
    loss, grads = lsj.value_and_grad(lambda p: loss_fn(p, x16)[0] * 100, big)(p16)
    assert loss.dtype == jnp.float16 and grads["w"].dtype == jnp.float16
    assert not np.isfinite(float(lsj.unscaled_global_norm(grads, big)))  # as the gradients


def test_an_nnx_optimizer_is_read_when_called():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    opt = lsj.LossScaleOptimizer(
        model, lsj.loss_scaling(optax.sgd(0.1), lsj.StaticScale(SCALE)), wrt=nnx.Param
    )

    def loss(m, x):
        return jnp.mean(m(x) ** 2)

    value, grads = lsj.value_and_grad(loss, opt, argnums=nnx.DiffState(0, nnx.Param))(model, X)
    want_value, want = nnx.value_and_grad(loss)(model, X)
    assert value == want_value
    np.testing.assert_array_equal(
        np.asarray(grads["kernel"][...]), np.asarray(want["kernel"][...]) * SCALE
    )
    np.testing.assert_allclose(
        float(lsj.unscaled_global_norm(grads, opt)),
        float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree_util.tree_leaves(want)))),
        rtol=1e-6,
    )


def test_bad_arguments_are_refused_naming_them():
    with pytest.raises(TypeError, match="fun must be callable"):
        lsj.value_and_grad(3, state())
    with pytest.raises(TypeError, match="has_aux must be a bool"):
        lsj.value_and_grad(loss_fn, state(), has_aux=1)
    with pytest.raises(ValueError, match="argnums must be an int >= 0"):
        lsj.value_and_grad(loss_fn, state(), argnums=-1)
    with pytest.raises(ValueError, match="opt_state contains no LossScaleState"):
        lsj.value_and_grad(loss_fn, optax.sgd(0.1).init(PARAMS))
