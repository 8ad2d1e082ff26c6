"""MindSpore's own loss-scale tests, run against ``lossscale_jax.compat.mindspore``.

Upstream: MindSpore's ``test_loss_scale.py`` (module docstring "test_loss_scale"; Ascend system
tests of ``TrainOneStepWithLossScaleCell``). ``NetFP16`` (16x16 ones weight and ones bias,
matmul in float16), ``MSELoss`` and the data (ones, labels zeros) are ported as written. A
fixed ``scale_sense`` tensor is ``compat.mindspore.FixedLossScaleManager(scale,
drop_overflow_update=True)`` (the cell skips the optimizer on overflow), ``set_sense_scale`` is
``lossscale_jax.set_loss_scale_state``, and the cell's outputs ``(loss, cond, scaling_sens)``
are the loss, ``metrics()["overflow"]`` and the scale. Every case passes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference_scalers import MindSporeDynamicLossScaleUpdateCell  # noqa: I001

import lossscale_jax as lsj
from lossscale_jax import compat

# Slow (make test-fast leaves it out): a port of the peer's own tests, several seconds in all.
pytestmark = pytest.mark.slow

F32_MAX = float(np.finfo(np.float32).max)
INPUTS = jnp.ones((16, 16), jnp.float32)
LABEL = jnp.zeros((16, 16), jnp.float32)


def _net_fp16_params():
    return {"weight": jnp.ones((16, 16), jnp.float32), "bias": jnp.ones((16,), jnp.float32)}


def _net_fp16(p, x):
    f16 = jnp.float16
    out = x.astype(f16) @ p["weight"].astype(f16) + p["bias"].astype(f16)
    return out.astype(jnp.float32)


def _mse(data, label):
    return jnp.mean(jnp.square(data - label))


class _TrainOneStepWithLossScaleCell:
    def __init__(self, optimizer, manager):
        self.params = _net_fp16_params()
        self.tx = lsj.loss_scaling(optimizer, manager)
        self.state = self.tx.init(self.params)

        def step(params, state, x, y):
            loss_fn = lambda p: _mse(_net_fp16(p, x), y)  # noqa: E731
            loss, grads = jax.value_and_grad(lambda p: lsj.scale_loss(loss_fn(p), state))(params)
            updates, state = self.tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss_fn(params)

        self._step = jax.jit(step)

    def __call__(self, inputs, label):
        self.params, self.state, loss = self._step(self.params, self.state, inputs, label)
        m = lsj.metrics(self.state)
        return loss, m["overflow"], m["loss_scale"]

    def set_sense_scale(self, sens):
        current = lsj.get_loss_scale_state(self.state)
        self.state = lsj.set_loss_scale_state(
            self.state, current.replace(scale=jnp.asarray(sens, jnp.float32).reshape(()))
        )


def _fixed_f32_max():
    return compat.mindspore.FixedLossScaleManager(F32_MAX, drop_overflow_update=True)


@pytest.mark.parametrize(
    "upstream, optimizer",
    [
        ("test_loss_scale_fp16_lr_overflow", optax.sgd(0.1, momentum=0.9)),  # Momentum
        ("test_loss_scale_fp16_opt_rmsprop_overflow", optax.rmsprop(0.1)),  # RMSProp
        ("test_loss_scale_fp16_overflow", optax.lamb(0.01)),  # Lamb
    ],
)
def test_loss_scale_fp16_overflow(upstream, optimizer):
    # Upstream: <upstream>: a float32-max scale overflows every step, so nothing is updated and
    # both steps see the same loss and cond == True.
    train_network = _TrainOneStepWithLossScaleCell(optimizer, _fixed_f32_max())
    output_1 = train_network(INPUTS, LABEL)
    output_2 = train_network(INPUTS, LABEL)
    assert float(output_1[0]) == float(output_2[0])
    assert bool(output_1[1]) and bool(output_2[1])
    np.testing.assert_array_equal(train_network.params["weight"], np.ones((16, 16)))


def test_loss_scale_fp16_lr_overflow_set_sense_scale():
    # Upstream: test_loss_scale_fp16_lr_overflow_set_sense_scale.
    train_network = _TrainOneStepWithLossScaleCell(optax.sgd(0.1, momentum=0.9), _fixed_f32_max())
    output_1 = train_network(INPUTS, LABEL)
    train_network.set_sense_scale(np.full((1), np.finfo(np.float32).max, np.float32))
    output_2 = train_network(INPUTS, LABEL)
    assert float(output_1[0]) == float(output_2[0])
    assert bool(output_1[1]) and bool(output_2[1])


def test_loss_scale_fp16_model_train_overflow():
    # Upstream: test_loss_scale_fp16_model_train_overflow: Model.train(2 epochs) with
    # DynamicLossScaleManager(init_loss_scale=16, scale_factor=2, scale_window=2) over MindData
    # (size 2: three batches an epoch). Upstream only runs it; here the scale must also follow
    # MindSpore's update cell step for step and the parameters stay finite.
    manager = compat.mindspore.DynamicLossScaleManager(
        init_loss_scale=16, scale_factor=2, scale_window=2
    )
    train_network = _TrainOneStepWithLossScaleCell(optax.sgd(0.1, momentum=0.9), manager)
    ref = MindSporeDynamicLossScaleUpdateCell(loss_scale_value=16, scale_factor=2, scale_window=2)
    for _ in range(2 * 3):
        _, cond, scale = train_network(INPUTS, LABEL)
        assert float(scale) == float(ref.step(bool(cond))[0])
    assert all(np.all(np.isfinite(np.asarray(v))) for v in train_network.params.values())
