"""DeepSpeed's own dynamic-loss-scale tests, run against ``lossscale_jax.compat.deepspeed``.

Upstream: ``tests/unit/runtime/half_precision/test_dynamic_loss_scale.py`` (DeepSpeed, classes
``TestFused`` and ``TestUnfused``). Those tests train with fp16 and no ZeRO, so the engine wraps
the optimizer in ``FP16_Optimizer`` (Adam, fused) or ``FP16_UnfusedOptimizer`` (Lamb), which run
their own ``_update_scale`` (not ``DynamicLossScaler``). The engine builds the optimizers'
``dynamic_loss_args`` from the ``fp16`` config with ``get_dynamic_loss_scale_args``:
``init_scale = 2**initial_scale_power``, ``scale_window = loss_scale_window``, and DeepSpeed's
defaults ``delayed_shift=2`` (``hysteresis``), ``consecutive_hysteresis=False``,
``min_scale=1`` unless ``min_loss_scale`` is set. Upstream sets every gradient to a value and
calls ``model.step()``; here those values are the gradients given to ``tx.update``, and
``optim.cur_scale``/``optim.cur_iter`` are ``metrics()["loss_scale"]``/``["total_steps"]``.
Numbers as upstream; every case passes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale_jax as lsj
from lossscale_jax import compat

# Slow (make test-fast leaves it out): a port of the peer's own tests, several seconds in all.
pytestmark = pytest.mark.slow

PARAMS = {"w": jnp.zeros((1, 1), jnp.float32), "b": jnp.zeros((1,), jnp.float32)}  # SimpleModel(1)


def _engine_args(initial_scale_power, loss_scale_window, min_loss_scale=1):
    """deepspeed/runtime/config.py get_dynamic_loss_scale_args for the tests' fp16 config."""
    return {
        "init_scale": 2**initial_scale_power,
        "scale_window": loss_scale_window,
        "delayed_shift": 2,
        "consecutive_hysteresis": False,
        "min_scale": min_loss_scale,
    }


class _Model:
    """The upstream test's engine: ``run_model_step`` fills every gradient with a value."""

    def __init__(self, fused, **fp16):
        args = _engine_args(**fp16)
        if fused:
            self.tx = compat.deepspeed.FP16_Optimizer(
                optax.adam(0.00015), dynamic_loss_scale=True, dynamic_loss_args=args
            )
        else:
            self.tx = compat.deepspeed.FP16_UnfusedOptimizer(
                optax.lamb(0.00015), dynamic_loss_scale=True, dynamic_loss_args=args
            )
        self.policy = compat.deepspeed.fp16_optimizer_policy(
            dynamic_loss_scale=True, dynamic_loss_args=args, unfused=not fused
        )
        self.params = PARAMS
        self.state = self.tx.init(PARAMS)
        self._update = jax.jit(self.tx.update)

    def run_model_step(self, gradient_list):
        for value in gradient_list:
            grads = jax.tree.map(lambda p, v=value: jnp.full(p.shape, v, jnp.float16), self.params)
            updates, self.state = self._update(grads, self.state, self.params)
            self.params = optax.apply_updates(self.params, updates)

    @property
    def cur_scale(self):
        return float(lsj.metrics(self.state)["loss_scale"])

    @property
    def cur_iter(self):
        return int(lsj.metrics(self.state)["total_steps"])


FUSED = [pytest.param(True, id="TestFused"), pytest.param(False, id="TestUnfused")]


@pytest.mark.parametrize("fused", FUSED)
def test_no_overflow(fused):
    # Upstream: TestFused.test_no_overflow, TestUnfused.test_no_overflow.
    model = _Model(fused, initial_scale_power=8, loss_scale_window=2)
    expected_loss_scale = 2**8
    expected_scale_window = 2
    # Ensure the dynamic loss scaler is correctly configured.
    assert model.cur_scale == expected_loss_scale
    assert model.policy.growth_interval - 1 == expected_scale_window  # optim.scale_window
    for i, value in enumerate(np.random.default_rng(0).uniform(-0.1, 0.1, 10)):
        model.run_model_step([value])
        assert model.cur_scale == expected_loss_scale
        assert model.cur_iter == (i + 1)
        if model.cur_iter % expected_scale_window == 0:
            expected_loss_scale *= 2


@pytest.mark.parametrize(
    "fused, fp16, expected_min_loss_scale",
    [
        pytest.param(True, dict(initial_scale_power=4, loss_scale_window=2), 1, id="TestFused"),
        pytest.param(
            False,
            dict(initial_scale_power=4, loss_scale_window=2, min_loss_scale=0.25),
            0.25,
            id="TestUnfused",
        ),
    ],
)
def test_all_overflow(fused, fp16, expected_min_loss_scale):
    # Upstream: TestFused.test_all_overflow (floor 1), TestUnfused.test_all_overflow (0.25).
    model = _Model(fused, **fp16)
    expected_loss_scale = 2**4
    assert model.cur_scale == expected_loss_scale
    assert model.policy.min_scale == expected_min_loss_scale  # optim.min_loss_scale
    overflow_gradients = [float("inf"), float("-inf")] + [float("nan")] * 6
    for i, value in enumerate(overflow_gradients):
        model.run_model_step([value])
        expected_loss_scale = max(expected_loss_scale / 2, expected_min_loss_scale)
        assert model.cur_scale == expected_loss_scale
        assert model.cur_iter == (i + 1)
    assert np.all(np.isfinite(np.asarray(model.params["w"])))


@pytest.mark.parametrize("fused", FUSED)
def test_some_overflow(fused):
    # Upstream: TestFused.test_some_overflow, TestUnfused.test_some_overflow.
    model = _Model(fused, initial_scale_power=8, loss_scale_window=2)
    expected_loss_scale = 2**8
    expected_scale_window = 2
    expected_iteration = 0
    assert model.cur_scale == expected_loss_scale
    assert model.policy.growth_interval - 1 == expected_scale_window

    # Run model with overflows to decrease scale
    overflow_gradients = [float("inf"), float("nan")]
    expected_iteration += len(overflow_gradients)
    model.run_model_step(overflow_gradients)
    expected_loss_scale /= 2 ** len(overflow_gradients)
    assert model.cur_scale == expected_loss_scale
    assert model.cur_iter == expected_iteration

    # Run model scale_window + 1 times to increase scale once
    normal_gradients = np.random.default_rng(1).uniform(-0.1, 0.1, expected_scale_window + 1)
    expected_iteration += len(normal_gradients)
    model.run_model_step(normal_gradients)
    expected_loss_scale *= 2
    assert model.cur_scale == expected_loss_scale
    assert model.cur_iter == expected_iteration

    # Run model with overflows to decrease scale
    overflow_gradients = [float("inf")]
    expected_iteration += len(overflow_gradients)
    model.run_model_step(overflow_gradients)
    expected_loss_scale /= 2 ** len(overflow_gradients)
    assert model.cur_scale == expected_loss_scale
    assert model.cur_iter == expected_iteration


def test_zero_scaler_would_grow_one_step_earlier():
    # Not upstream: the same gradients through DeepSpeed's ZeRO scaler (DynamicLossScaler, with
    # the engine's hysteresis 2 switched off) grow one step earlier, which is why these tests
    # need the fp16 optimizers' own rule.
    policy = compat.deepspeed.DynamicLossScaler(init_scale=2.0**8, scale_window=2)
    tx = lsj.loss_scaling(optax.adam(0.00015), policy)
    state = tx.init(PARAMS)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.05, jnp.float16), PARAMS)
    got = []
    for _ in range(4):
        _, state = tx.update(grads, state, PARAMS)
        got.append(float(state.loss_scale.scale))
    assert got == [256, 512, 512, 1024]  # FP16_Optimizer: 256, 256, 512, 512
