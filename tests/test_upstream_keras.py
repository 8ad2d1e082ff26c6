"""Keras 3's own ``LossScaleOptimizer`` tests, run against ``lossscale_jax.compat.keras``.

Upstream: ``keras/src/optimizers/loss_scale_optimizer_test.py`` (Keras 3.15, class
``LossScaleOptimizerTest``; on the JAX backend upstream runs only the ``stateless`` variants).
Each test names the upstream test it ports and keeps upstream's numbers: a Keras
``SGD(learning_rate=0.5)`` is ``optax.sgd(0.5)``, ``stateless_apply`` is ``tx.update`` plus
``optax.apply_updates``, and ``optimizer.scale_loss(1.0)`` is ``lsj.scale_loss(1.0, state)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale_jax as lsj
from lossscale_jax import compat

VARS = jnp.array([1.0, 2.0, 3.0, 4.0], jnp.float32)


def _apply(tx, grads, state, params=VARS):
    updates, state = jax.jit(tx.update)(grads, state, params)
    return optax.apply_updates(params, updates), state


@pytest.mark.parametrize("upstream", ["test_finite_step[stateless]", "test_apply_with_no_vars"])
def test_finite_step(upstream):
    # Upstream: test_finite_step (stateless) and test_apply_with_no_vars (same numbers).
    tx = compat.keras.LossScaleOptimizer(optax.sgd(0.5))
    state = tx.init(VARS)
    initial_scale = float(lsj.scale_loss(1.0, state))
    assert initial_scale == 2.0**15  # optimizer.initial_scale
    grads = jnp.array([1.0, 6.0, 7.0, 2.0]) * initial_scale
    new_vars, _ = _apply(tx, grads, state)
    np.testing.assert_allclose(new_vars, [0.5, -1.0, -0.5, 3.0], rtol=1e-4, atol=1e-4)


def test_infinite_step():
    # Upstream: test_infinite_step (stateless).
    tx = compat.keras.LossScaleOptimizer(optax.sgd(0.5))
    grads = jnp.array([np.inf, np.inf, np.inf, np.inf])
    new_vars, _ = _apply(tx, grads, tx.init(VARS))
    np.testing.assert_allclose(new_vars, [1.0, 2.0, 3.0, 4.0], rtol=1e-4, atol=1e-4)


def test_downscaling():
    # Upstream: test_downscaling (stateless): 400 halved four times is 25.
    tx = compat.keras.LossScaleOptimizer(optax.sgd(0.5), initial_scale=400.0)
    state = tx.init(VARS)
    grads = jnp.array([np.inf, np.inf, np.inf, np.inf])
    for _ in range(4):
        _, state = _apply(tx, grads, state)
    np.testing.assert_allclose(lsj.scale_loss(1.0, state), 25.0)


def test_upscaling():
    # Upstream: test_upscaling (stateless): 2 doubled every 2 good steps, 8 steps: 32.
    tx = compat.keras.LossScaleOptimizer(optax.sgd(0.5), initial_scale=2.0, dynamic_growth_steps=2)
    state = tx.init(VARS)
    grads = jnp.array([1.0, 6.0, 7.0, 2.0])
    for _ in range(8):
        _, state = _apply(tx, grads, state)
    np.testing.assert_allclose(lsj.scale_loss(1.0, state), 32.0)


def test_iterations_update():
    # Upstream: test_iterations_update (stateless): optimizer.iterations counts the steps; here
    # that count is metrics()["total_steps"].
    tx = compat.keras.LossScaleOptimizer(optax.sgd(0.5))
    state = tx.init(VARS)
    grads = jnp.array([1.0, 6.0, 7.0, 2.0])
    assert int(lsj.metrics(state)["total_steps"]) == 0
    for i in range(3):
        _, state = _apply(tx, grads, state)
        assert int(lsj.metrics(state)["total_steps"]) == i + 1


def test_init_dynamic_arg():
    # Upstream: test_init_dynamic_arg.
    compat.keras.LossScaleOptimizer(optax.sgd(0.5), dynamic=True)
    with pytest.raises(ValueError, match="set `loss_scale_factor`"):
        compat.keras.LossScaleOptimizer(optax.sgd(0.5), dynamic=False)


def test_init_unsupported_arg():
    # Upstream: test_init_unsupported_arg.
    with pytest.raises(ValueError, match="arguments: `foo`, `bar`"):
        compat.keras.LossScaleOptimizer(optax.sgd(0.5), foo=True, bar=3)


@pytest.mark.parametrize(
    "arg_name, arg_value",
    [
        ("weight_decay", 0.5),
        ("clipnorm", 0.5),
        ("global_clipnorm", 0.5),
        ("clipvalue", 0.5),
        ("use_ema", True),
        ("ema_momentum", 0.5),
        ("ema_overwrite_frequency", 2),
        ("loss_scale_factor", 0.5),
        ("gradient_accumulation_steps", 2),
    ],
)
def test_init_base_optimizer_unsupported_args(arg_name, arg_value):
    # Upstream: test_init_base_optimizer_unsupported_args.
    with pytest.raises(ValueError, match="on the `inner_optimizer`"):
        compat.keras.LossScaleOptimizer(optax.sgd(0.5), **{arg_name: arg_value})


def test_deserialization_backwards_compatibility():
    # Upstream: test_deserialization_backwards_compatibility: an old config carries every base
    # optimizer argument at its default, and is accepted. (The config machinery itself,
    # from_config, is Keras's; the arguments are what this constructor is given.)
    config = {
        "name": "loss_scale_optimizer",
        "weight_decay": None,
        "clipnorm": None,
        "global_clipnorm": None,
        "clipvalue": None,
        "use_ema": False,
        "ema_momentum": 0.99,
        "ema_overwrite_frequency": None,
        "loss_scale_factor": None,
        "gradient_accumulation_steps": None,
        "initial_scale": 2.0,
        "dynamic_growth_steps": 2,
    }
    tx = compat.keras.LossScaleOptimizer(optax.sgd(0.5), **config)
    assert float(lsj.scale_loss(1.0, tx.init(VARS))) == 2.0
