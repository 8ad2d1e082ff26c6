"""``lossscale_jax.integrations._host``: what every host integration needs, host-free.

These run without any host installed: an NNX model of Flax's own layers for the compute
dtype switch, numbers worked by hand for the mismatch metrics, a plain Optax loop for the
loss wrapper and the metrics.
"""

from __future__ import annotations

import inspect
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import lossscale_jax as lsj
from lossscale_jax.errors import IntegrationError, IntegrationWarning
from lossscale_jax.integrations._host import _changes, _dtype, _grad, _metrics, _mismatch


class RMSNorm(nnx.Module):
    """A norm that computes in its ``dtype`` (as EasyDeL's does for float16), its output
    cast back to its input's dtype."""

    def __init__(self):
        self.dtype = jnp.float32

    def __call__(self, x):
        y = x.astype(jnp.promote_types(self.dtype, x.dtype))
        return (y * jax.lax.rsqrt(jnp.mean(jnp.square(y), -1, keepdims=True))).astype(x.dtype)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = RMSNorm()
        self.dense = nnx.Linear(8, 8, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x):
        return self.dense(self.norm(x))


class Bare(nnx.Module):  # computes in its parameters' dtype: no `dtype` of its own
    def __init__(self, dtype):
        self.w = nnx.Param(jnp.ones((4,), dtype))

    def __call__(self, x):
        return x * self.w


def test_the_compute_dtype_switch_keeps_norms_in_float32():
    model = Block(nnx.Rngs(0))
    x = jnp.full((2, 8), 300.0, jnp.float16)  # mean of squares 9e4: past float16's max
    change = _dtype.compute_dtype_change(model, jnp.float16, "host")
    assert model.dense.dtype == jnp.float32  # checked, not yet changed
    change()
    assert model.dense.dtype == np.float16 and model.norm.dtype == np.float32
    assert _dtype.compute_dtype_of(model) == np.float16
    assert model(x).dtype == jnp.float16
    np.testing.assert_array_equal(model.norm(x), np.ones((2, 8), np.float16))
    # The same norm in float16: its mean of squares is inf, and rsqrt(inf) makes it 0.
    model.norm.dtype = jnp.float16
    np.testing.assert_array_equal(model.norm(x), np.zeros((2, 8), np.float16))


def test_a_model_without_a_compute_dtype_is_refused_unless_its_params_are_that_dtype():
    with pytest.raises(IntegrationError, match=r"has no compute dtype.*compute_dtype=None"):
        _dtype.compute_dtype_change(Bare(jnp.float32), jnp.float16, "host")
    _dtype.compute_dtype_change(Bare(jnp.float16), jnp.float16, "host")()  # nothing to do
    assert _dtype.compute_dtype_of(Bare(jnp.bfloat16)) == jnp.bfloat16


def test_the_checks_come_before_the_changes():
    done = []
    target = type("Trainer", (), {})()
    changes = [_changes.refuse_twice(target, "host"), lambda: done.append(1)]
    assert not done
    _changes.apply(changes)
    assert done == [1]
    with pytest.raises(IntegrationError, match=r"host\.enable\(\) was called on this Trainer"):
        _changes.refuse_twice(target, "host")


def test_the_default_policy_follows_the_compute_dtype():
    assert isinstance(_changes.default_policy(None, jnp.float16), lsj.DynamicScale)
    assert isinstance(_changes.default_policy(None, None), lsj.DynamicScale)
    for dtype in (jnp.bfloat16, jnp.float32):
        policy = _changes.default_policy(None, dtype)
        assert isinstance(policy, lsj.NoScale) and policy.constant_scale == 1.0
    with pytest.warns(IntegrationWarning, match="bfloat16 has float32's range"):
        _changes.default_policy(lsj.StaticScale(8.0), jnp.bfloat16)


def enable(policy, dtype, stacklevel=3):
    """A host's enable(), as the hosts call default_policy (directly, stacklevel 3)."""
    return _changes.default_policy(policy, dtype, stacklevel=stacklevel)


def test_the_warning_points_at_the_line_that_called_enable():
    with pytest.warns(IntegrationWarning) as got:
        line = inspect.currentframe().f_lineno + 1
        enable(lsj.StaticScale(8.0), jnp.bfloat16)
    assert (got[0].filename, got[0].lineno) == (__file__, line)


def test_the_scaled_loss_gives_the_float32_gradients_and_metrics():
    params = {"w": jnp.asarray([1e-3, -2e-3], jnp.float32)}
    tx = lsj.loss_scaling(optax.sgd(1.0), lsj.StaticScale(2.0**10))
    opt_state = tx.init(params)

    def loss_fn(p, x):
        return jnp.sum(p["w"].astype(jnp.float16) * x) * jnp.float16(1e-4), "aux"

    x = jnp.asarray([1.0, 1.0], jnp.float16)
    (loss, aux), grads = _grad.scaled(loss_fn, opt_state, has_aux=True)(params, x)
    plain = _grad.unscaled(grads, opt_state)
    assert aux == "aux" and plain["w"].dtype == jnp.float32
    np.testing.assert_allclose(plain["w"], np.float16(1e-4), rtol=1e-3)
    np.testing.assert_allclose(grads["w"], 2.0**10 * np.float16(1e-4), rtol=1e-3)
    used = _metrics.scale_used(opt_state)
    _, opt_state = tx.update(grads, opt_state, params)
    got = _metrics.scale_metrics(opt_state, used)
    assert set(got) == {f"loss_scale/{k}" for k in _metrics.KEYS}
    assert float(got["loss_scale/loss_scale"]) == float(got["loss_scale/scale_used"]) == 2.0**10
    assert not bool(got["loss_scale/skipped"])


def _step(tx, opt_state, grads, loss):
    """One update of ``tx``; what the step says of itself (``_metrics.why``), as a dict."""
    params = jax.tree_util.tree_map(jnp.zeros_like, grads)
    used = _metrics.scale_used(opt_state)
    _, opt_state = tx.update(grads, opt_state, params)
    return opt_state, _metrics.why(jnp.float32(loss), opt_state, used)


def test_the_first_skip_says_which_leaf_overflowed_and_what_the_scale_did(caplog):
    tx = lsj.loss_scaling(optax.sgd(1.0), lsj.DynamicScale(init_scale=2.0**15))
    grads = {"a": jnp.ones(2), "b": jnp.asarray([1.0, jnp.inf])}
    leaves = _metrics.Leaves()
    leaves.note(grads)
    teller = _metrics.Teller(logging.getLogger("host"), "the trainer", leaves)
    opt_state = tx.init(grads)
    with caplog.at_level(logging.WARNING, "host"):
        opt_state, fine = _step(tx, opt_state, {"a": jnp.ones(2), "b": jnp.ones(2)}, 1.0)
        assert teller.seen([fine]) is False
        for _ in range(2):
            opt_state, why = _step(tx, opt_state, grads, 1.0)
            assert teller.seen([why]) is True
    assert caplog.text.count("the trainer skipped an optimizer step") == 1
    # The scale used, the leaf by its path, the back-off by the numbers (2**15 halved).
    assert "scaled by 32768, overflowed (inf or nan): the gradient of ['b']" in caplog.text
    assert "backed off from 32768 to 16384" in caplog.text
    assert "stuck" not in caplog.text  # a dynamic scale that can still go lower


def test_a_nan_loss_under_a_static_scale_is_said_and_then_stuck(caplog):
    tx = lsj.loss_scaling(optax.sgd(1.0), lsj.StaticScale(8.0))
    grads = {"w": jnp.asarray([jnp.nan])}
    teller = _metrics.Teller(logging.getLogger("host"), "the trainer")
    opt_state = tx.init(grads)
    with caplog.at_level(logging.WARNING, "host"):
        for _ in range(_metrics.STUCK_AFTER + 2):
            opt_state, why = _step(tx, opt_state, grads, jnp.nan)
            teller.seen([why])
    first, stuck = caplog.records  # each said once
    assert "its loss itself was not finite" in first.getMessage()
    assert "stayed at 8" in first.getMessage() and "backed off" not in first.getMessage()
    assert f"its last {_metrics.STUCK_AFTER} optimizer steps were all skipped" in (
        stuck.getMessage()
    )
    assert "the loss itself is not finite" in stuck.getMessage()


def test_a_window_is_read_as_one_step():
    # Two micro-batches: the first's loss is not finite, the second's decision is the step's.
    tx = lsj.loss_scaling(optax.sgd(1.0), lsj.StaticScale(4.0))
    teller = _metrics.Teller(logging.getLogger("host"), "the trainer")
    opt_state = tx.init({"w": jnp.zeros(1)})
    opt_state, first = _step(tx, opt_state, {"w": jnp.ones(1)}, jnp.inf)
    _, second = _step(tx, opt_state, {"w": jnp.asarray([jnp.inf])}, 1.0)
    assert teller.seen([first, second]) is True
    assert teller.in_a_row == 1  # the window's loss was not finite: no scale fixes it


def test_the_mismatch_metrics_by_hand():
    # d = log r: 0, log 1.5 (outside a 0.2 clip range), -log 2 (outside), then a token the
    # rollout gave no log-prob for (nan) and one the mask leaves out.
    rollout = jnp.asarray([[-1.0, -2.0, -0.5, jnp.nan, -1.0]], jnp.float32)
    d = np.array([0.0, np.log(1.5), -np.log(2.0)], np.float32)
    trainer = rollout.at[0, :3].add(d).at[0, 3].set(-1.0)
    mask = jnp.asarray([[1, 1, 1, 1, 0]])
    got = {k: float(v) for k, v in _mismatch.mismatch(trainer, rollout, mask, (0.2, 0.2)).items()}
    np.testing.assert_allclose(got["mismatch/kl"], np.mean(np.expm1(d) - d), rtol=1e-6)
    np.testing.assert_allclose(got["mismatch/abs_log_ratio"], np.mean(np.abs(d)), rtol=1e-6)
    np.testing.assert_allclose(got["mismatch/max_abs_log_ratio"], np.log(2.0), rtol=1e-6)
    np.testing.assert_allclose(got["mismatch/clip_fraction"], 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(got["mismatch/exact_fraction"], 1 / 3, rtol=1e-6)
    assert set(got) == set(_mismatch.METRICS)
