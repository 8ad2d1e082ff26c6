"""TF1 ``contrib.mixed_precision``'s own tests, run against ``lossscale_jax.compat.npu``.

Upstream: ``tensorflow/contrib/mixed_precision/python/loss_scale_manager_test.py`` and
``loss_scale_optimizer_test.py`` (TensorFlow 1.x; npu_bridge's managers subclass these). Each test
names the upstream test it ports and keeps upstream's inputs and expected outputs. Upstream feeds
"gradients are finite" flags; the overflow flag here is their negation. ``LossScaleOptimizer(opt,
manager)`` is ``compat.npu.NPULossScaleOptimizer(opt, manager, overflow="ieee")`` (TF1 checks
``is_finite``; the NPU default also checks saturation). One documented deviation:
``test_keep_increasing_until_capped``, where npu_bridge's growth limit (which ``compat.npu``
follows) stops one doubling short of TF1's float32 max.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import run_policy  # noqa: I001  (tests/ is on sys.path under pytest)

import lossscale_jax as lsj
from lossscale_jax import compat

# Slow (make test-fast leaves it out): a port of the peer's own tests, several seconds in all.
pytestmark = pytest.mark.slow

F32_MAX = float(np.finfo(np.float32).max)


# --------------------------------------------------------------------------
# loss_scale_manager_test.py


def test_fixed_loss_scale_manager_basic():
    # Upstream: FixedLossScaleManagerTest.test_basic.
    inputs = [True] * 10 + [False] * 10
    loss_scale = 1000
    lsm = compat.npu.FixedLossScaleManager(loss_scale)
    got = run_policy(lsm, np.logical_not(inputs[:10])).scale
    assert got.tolist() == [loss_scale] * 10


def _exponential(inputs, init_loss_scale=1, incr_every_n_step=2, decr_every_n_nan_or_inf=2):
    """ExponentialUpdateLossScaleManagerTest._test_helper: the scale after each input."""
    ratio = 2
    lsm = compat.npu.ExponentialUpdateLossScaleManager(
        init_loss_scale=init_loss_scale,
        incr_every_n_steps=incr_every_n_step,
        decr_every_n_nan_or_inf=decr_every_n_nan_or_inf,
        incr_ratio=ratio,
        decr_ratio=1.0 / ratio,
    )
    return run_policy(lsm, np.logical_not(inputs)).scale.tolist()


CASES = {
    "test_increase_every_n_steps": (dict(inputs=[True] * 6), [1, 2, 2, 4, 4, 8]),
    "test_decrease_every_n_steps": (
        dict(inputs=[False] * 6, init_loss_scale=1024),
        [1024, 512, 512, 256, 256, 128],
    ),
    "test_keep_decreasing_until_one": (
        dict(inputs=[False] * 10, init_loss_scale=16),
        [16, 8, 8, 4, 4, 2, 2, 1, 1, 1],
    ),
    "test_incr_bad_step_clear_good_step": (
        dict(inputs=[True, True, True, False, True]),
        [1, 2, 2, 2, 2],
    ),
    "test_incr_good_step_does_not_clear_bad_step": (
        dict(inputs=[True, True, True, False, True, False]),
        [1, 2, 2, 2, 2, 1],
    ),
    "test_trigger_loss_scale_update_each_step": (
        dict(
            inputs=[True] * 3 + [False, True, True], incr_every_n_step=1, decr_every_n_nan_or_inf=1
        ),
        [2, 4, 8, 4, 8, 16],
    ),
    "test_alternating_good_and_bad_gradients_trigger_each_step": (
        dict(inputs=[True, False] * 4 + [True], incr_every_n_step=1, decr_every_n_nan_or_inf=1),
        [2, 1, 2, 1, 2, 1, 2, 1, 2],
    ),
    "test_alternating_good_and_bad_gradients_trigger_incr_every_2steps": (
        dict(
            inputs=[True, False] * 3 + [True],
            init_loss_scale=32,
            incr_every_n_step=2,
            decr_every_n_nan_or_inf=1,
        ),
        [32, 16, 16, 8, 8, 4, 4],
    ),
    "test_random_mix_good_and_bad_gradients": (
        dict(
            inputs=[False, False, True, True, True, False, True, False, True, True, True, False],
            init_loss_scale=4,
        ),
        [4, 2, 2, 4, 4, 4, 4, 2, 2, 4, 4, 4],
    ),
}


@pytest.mark.parametrize("upstream", sorted(CASES))
def test_exponential_update_loss_scale_manager(upstream):
    # Upstream: ExponentialUpdateLossScaleManagerTest.<upstream>.
    kwargs, expected_outputs = CASES[upstream]
    assert _exponential(**kwargs) == expected_outputs


def test_keep_increasing_until_capped():
    # Upstream: ExponentialUpdateLossScaleManagerTest.test_keep_increasing_until_capped expects
    # [init, 2 init, 2 init, max, max, max]: TF1 grows while the result is finite. Documented
    # deviation: npu_bridge (compat.npu) grows only while scale < 3.4e38 / 2, and 2 * init =
    # float32 max / 2 = 1.7014e38 is not below float32(1.7e38), so it stops there.
    init_loss_scale = np.finfo(np.float32).max / 4 + 10
    inputs = [True] * 6
    got = _exponential(inputs, init_loss_scale)
    expected_tf1 = [
        init_loss_scale,
        init_loss_scale * 2,
        init_loss_scale * 2,
        F32_MAX,
        F32_MAX,
        F32_MAX,
    ]
    expected_npu_bridge = expected_tf1[:3] + [init_loss_scale * 2] * 3
    assert got == expected_npu_bridge
    assert got[:3] == expected_tf1[:3]


# --------------------------------------------------------------------------
# loss_scale_optimizer_test.py


def _build_graph(lr, init_val, loss_scale_opt_fn=None):
    """LossScaleOptimizerTest._build_graph: a float16 loss whose gradient underflows."""
    x = jnp.float32(init_val)
    c1 = jnp.float16(1e4)
    c2 = jnp.float16(1e-4)
    c3 = jnp.float16(1e-4)

    def loss(x):
        return x.astype(jnp.float16) * c1 * c2 * c3

    opt = optax.sgd(lr)
    if loss_scale_opt_fn:
        opt = loss_scale_opt_fn(opt)
    return x, loss, opt


def _minimize(x, loss, opt):
    state = opt.init(x)
    grads = jax.grad(lambda p: lsj.scale_loss(loss(p), state))(x)
    updates, _ = opt.update(grads, state, x)
    return optax.apply_updates(x, updates)


def _fixed_1e4(opt):
    return compat.npu.NPULossScaleOptimizer(
        opt, compat.npu.FixedLossScaleManager(1e4), overflow="ieee"
    )


def test_float16_underflow_without_loss_scale():
    # Upstream: LossScaleOptimizerTest.test_float16_underflow_without_loss_scale.
    lr = 1
    init_val = 1.0
    x, loss, opt = _build_graph(lr, init_val)
    x = optax.apply_updates(x, opt.update(jax.grad(loss)(x), opt.init(x), x)[0])
    # Symbolic grad is c1 * c2 * c3 = 1e-4 and actual grad is 0, since in backprop, c2 * c3
    # underflows in fp16 range. So variable isn't updated.
    expected_update = 0
    symbolic_update = 1e-4 * lr
    np.testing.assert_allclose(
        init_val - expected_update, x, rtol=0, atol=min(symbolic_update, 1e-6)
    )


def test_float16_with_loss_scale():
    # Upstream: LossScaleOptimizerTest.test_float16_with_loss_scale.
    lr = 1.0
    init_val = 1.0
    x, loss, opt = _build_graph(lr, init_val, _fixed_1e4)
    x = _minimize(x, loss, opt)
    # Symbolic grad is c1 * c2 * c3 = 1e-4 and actual grad is the same, due to up-scaled loss
    # before backprop starts.
    expected_update = 1.0e-4 * lr
    np.testing.assert_allclose(
        init_val - expected_update, x, rtol=0, atol=min(expected_update, 1e-6)
    )


def test_compute_gradients_with_loss_scale():
    # Upstream: LossScaleOptimizerTest.test_compute_gradients_with_loss_scale: the unscaled
    # gradient (compute_gradients) is 1e-4; nothing is applied.
    x, loss, opt = _build_graph(1, 1.0, _fixed_1e4)
    state = opt.init(x)
    scaled = jax.grad(lambda p: lsj.scale_loss(loss(p), state))(x)
    g_v = lsj.unscale(scaled, lsj.get_loss_scale_state(state).scale)
    np.testing.assert_allclose(g_v, 1e-4, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(1.0, x, rtol=0, atol=1e-6)


def test_compute_gradients_without_loss_scale():
    # Upstream: LossScaleOptimizerTest.test_compute_gradients_without_loss_scale.
    x, loss, _ = _build_graph(1, 1.0)
    np.testing.assert_allclose(jax.grad(loss)(x), 0, rtol=1e-6, atol=1e-6)


def test_apply_gradients():
    # Upstream: LossScaleOptimizerTest.test_apply_gradients: gradients nan, inf, 0.1 give
    # x = 1, 1, 1 - 0.1. (The update here takes the scaled gradient: 0.1 * 1e4.)
    x = jnp.float32(1.0)
    opt = _fixed_1e4(optax.sgd(1))
    state = opt.init(x)
    actual_output = []
    for g in [np.nan, np.inf, 0.1]:
        updates, state = opt.update(jnp.float32(g * 1e4), state, x)
        x = optax.apply_updates(x, updates)
        actual_output.append(float(x))
    np.testing.assert_allclose(actual_output, [1, 1, 1 - 0.1], rtol=1e-6, atol=1e-6)


@dataclasses.dataclass(frozen=True)
class SimpleLossScaleManager(lsj.LossScalePolicy):
    """The upstream test's manager: scale + 1 after finite gradients, - 1 otherwise."""

    loss_scale: float

    def init(self):
        return lsj.StaticScale(self.loss_scale).init()

    def adjust(self, state, overflow):
        overflow = jnp.asarray(overflow, jnp.bool_)
        return state.replace(
            scale=jnp.where(overflow, state.scale - 1, state.scale + 1),
            last_overflow=overflow,
            last_skipped=overflow,
        )


def test_apply_gradients_loss_scale_is_updated():
    # Upstream: LossScaleOptimizerTest.test_apply_gradients_loss_scale_is_updated: a user's
    # manager drives the optimizer (here a user's LossScalePolicy).
    x = jnp.float32(1.0)
    init_loss_scale = 8
    lsm = SimpleLossScaleManager(init_loss_scale)
    opt = compat.npu.NPULossScaleOptimizer(optax.sgd(1), lsm, overflow="ieee")
    state = opt.init(x)
    expected_loss_scale = [init_loss_scale - 1, init_loss_scale - 2, init_loss_scale - 2 + 1]
    actual_output = []
    for i, g in enumerate([np.nan, np.inf, 0.1]):
        scale = float(lsj.get_loss_scale_state(state).scale)
        updates, state = opt.update(jnp.float32(g * scale), state, x)
        x = optax.apply_updates(x, updates)
        actual_output.append(float(x))
        np.testing.assert_allclose(expected_loss_scale[i], float(state.loss_scale.scale))
    np.testing.assert_allclose(actual_output, [1, 1, 1 - 0.1], rtol=1e-6, atol=1e-6)
