"""PaddlePaddle's scalers (``lossscale_jax.compat.paddle``), step for step.

``GradScaler`` (``python/paddle/amp/grad_scaler.py``) and the static-graph
``update_loss_scaling`` op (``paddle/phi/kernels/impl/amp_kernel_impl.h``) are compared on
seeded overflow sequences (bursts, long good runs, noise) with their rules transcribed in
``tests/reference_paddle.py``: scale, skip and both counters after every step. Paddle's op test
(``test/legacy_test/test_update_loss_scaling_op.py``) is re-expressed with its numbers, and a
``state_dict`` is exported mid-run, imported and continued. One compile per configuration.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import run_policy
from reference_paddle import PaddleGradScaler, PaddleUpdateLossScalingOp
from reference_scalers import comparable_prefix

import lossscale_jax as lsj
from lossscale_jax import compat

F32 = np.float32
TINY = float(np.finfo(np.float32).tiny)
F32_MAX = float(np.finfo(np.float32).max)
N = 400


def _sequences():
    """Three seeded sequences of N flags: bursts with good runs, sparse noise, dense noise."""
    rng = np.random.default_rng(2626)
    runs: list[bool] = []
    while len(runs) < N:
        runs += [True] * int(rng.integers(1, 6)) + [False] * int(rng.choice([1, 2, 5, 30]))
    return [np.asarray(runs[:N], bool), rng.random(N) < 0.05, rng.random(N) < 0.45]


SEQS = _sequences()


def _reference_run(ref, seq):
    """(scale, skipped, good count, bad count) after each step of the reference."""
    out = []
    for f in seq:
        scale, skipped = ref.step(bool(f))
        if isinstance(ref, PaddleGradScaler):
            out.append((scale, skipped, ref._incr_count, ref._decr_count))
        else:
            out.append((scale, skipped, ref.good, ref.bad))
    return out


def _check(policy, make_reference):
    """Ours against the reference on each sequence; the comparable lengths (float32's range)."""
    lengths = []
    for seq in SEQS:
        ours = run_policy(policy, seq)
        ref = _reference_run(make_reference(), seq)
        scales = [s for s, _, _, _ in ref]
        m = comparable_prefix(scales, TINY, F32_MAX)
        assert ours.scale.dtype == np.float32 and ours.growth_count.dtype == np.int32
        np.testing.assert_array_equal(ours.scale[:m], [F32(s) for s in scales[:m]])
        np.testing.assert_array_equal(ours.last_skipped, seq)
        np.testing.assert_array_equal(ours.growth_count[:m], [g for _, _, g, _ in ref[:m]])
        np.testing.assert_array_equal(ours.hysteresis_count[:m], [b for _, _, _, b in ref[:m]])
        # Past float32's range: ours stays finite and >= 2**-126 (Paddle: inf, or below).
        assert np.all(np.isfinite(ours.scale)) and np.all(ours.scale >= F32(TINY))
        lengths.append(m)
    return lengths


GRAD_SCALER = [  # (config, every sequence stays in float32's range)
    (dict(init_loss_scaling=2.0**16, incr_every_n_steps=8, decr_every_n_nan_or_inf=2), True),
    (
        dict(
            init_loss_scaling=1000.0,
            incr_ratio=1.5,
            decr_ratio=0.8,
            incr_every_n_steps=5,
            decr_every_n_nan_or_inf=3,
        ),
        True,
    ),
    # leaves float32's range: below 2**-126 (Paddle has no floor) and up to inf
    (dict(init_loss_scaling=2.0**-118, incr_every_n_steps=2), False),
    (
        dict(
            init_loss_scaling=2.0**120,
            incr_ratio=4.0,
            incr_every_n_steps=1,
            decr_every_n_nan_or_inf=3,
        ),
        False,
    ),
]


@pytest.mark.parametrize(("config", "in_range"), GRAD_SCALER)
def test_grad_scaler_matches_amp_scaler_update(config, in_range):
    lengths = _check(compat.paddle.GradScaler(**config), lambda: PaddleGradScaler(**config))
    assert (min(lengths) == N) == in_range
    assert min(lengths) > 0


OP = [
    # floor at 1 reached by the dense sequence; 0.8 is not a float32 number
    dict(prev=8.0, incr_every_n_steps=4, decr_every_n_nan_or_inf=1, incr_ratio=2.0, decr_ratio=0.8),
    # a growth to inf is refused
    dict(
        prev=2.0**120,
        incr_every_n_steps=1,
        decr_every_n_nan_or_inf=3,
        incr_ratio=2.0,
        decr_ratio=0.5,
    ),
    dict(
        prev=2.0**16,
        incr_every_n_steps=3,
        decr_every_n_nan_or_inf=1,
        incr_ratio=3.0,
        decr_ratio=0.5,
    ),
]


@pytest.mark.parametrize("config", OP)
def test_update_loss_scaling_matches_kernel(config):
    args = {k: v for k, v in config.items() if k != "prev"}
    policy = compat.paddle.update_loss_scaling(init_loss_scaling=config["prev"], **args)
    assert _check(policy, lambda: PaddleUpdateLossScalingOp(config["prev"], **args)) == [N] * 3
    ours = run_policy(policy, SEQS[2])
    assert ours.scale.min() >= 1.0
    if config["prev"] == 8.0:
        assert ours.stuck.any() and (ours.scale == 1.0).any()  # the floor is reached
    if config["prev"] == 2.0**120:
        assert ours.scale.max() == F32(2.0**127)  # the next growth, to inf, was refused


# --------------------------------------------------------------------------
# test/legacy_test/test_update_loss_scaling_op.py, with its numbers: prev_loss_scaling 2048,
# num_good_steps 999, num_bad_steps 1, incr_every_n_steps 1000, decr_every_n_nan_or_inf 2,
# incr_ratio 2, decr_ratio 0.8 (TestUpdateLossScalingOp, ...FP16Op, ...BF16Op, ...OpBad and
# TestUpdateLossScalingLayer's check and check_inf: the gradient dtype does not enter the rule).


def _op_state():
    policy = compat.paddle.update_loss_scaling(2048.0, 1000, 2, 2.0, 0.8)
    state = policy.init().replace(
        growth_count=jnp.asarray(999, jnp.int32), hysteresis_count=jnp.asarray(1, jnp.int32)
    )
    return policy, state


def test_upstream_update_loss_scaling_op_good_step_grows():
    policy, state = _op_state()
    out = policy.adjust(state, False)
    expected = np.array([2048]).astype(np.float32) * 2.0  # LossScaling
    assert np.float32(out.scale) == expected[0]
    assert int(out.growth_count) == 0 and int(out.hysteresis_count) == 0  # zero_steps
    assert not bool(out.last_skipped)  # Out equals X


def test_upstream_update_loss_scaling_op_bad_step_backs_off():
    policy, state = _op_state()
    out = policy.adjust(state, True)
    expected = np.array([2048]).astype(np.float32) * 0.8  # float32: 1638.4
    assert expected.dtype == np.float32 and np.float32(out.scale) == expected[0]
    assert int(out.growth_count) == 0 and int(out.hysteresis_count) == 0
    assert bool(out.last_skipped)  # Out is zeros: the step is void


def test_upstream_grad_scaler_docstring_values():
    """GradScaler's get_* examples: 1024, 2.0, 0.5, 1000, 2, dynamic, enabled."""
    p = compat.paddle.GradScaler(
        enable=True,
        init_loss_scaling=1024,
        incr_ratio=2.0,
        decr_ratio=0.5,
        incr_every_n_steps=1000,
        decr_every_n_nan_or_inf=2,
        use_dynamic_loss_scaling=True,
    )
    assert isinstance(p, lsj.DynamicScale)
    assert float(p.init().scale) == 1024.0
    assert (p.growth_factor, p.backoff_factor) == (2.0, 0.5)
    assert (p.growth_interval, p.hysteresis, p.consecutive_hysteresis) == (1000, 2, True)


def test_grad_scaler_defaults_and_switches():
    p = compat.paddle.GradScaler()
    assert isinstance(p, lsj.DynamicScale)
    assert (p.init_scale, p.growth_interval, p.hysteresis) == (2.0**16, 2000, 1)
    assert (p.min_scale, p.max_scale) == (TINY, float("inf"))
    static = compat.paddle.GradScaler(init_loss_scaling=128.0, use_dynamic_loss_scaling=False)
    assert static == lsj.StaticScale(128.0, skip_on_overflow=True)
    assert compat.paddle.GradScaler(enable=False) == lsj.NoScale()
    op = compat.paddle.update_loss_scaling()
    assert (op.init_scale, op.growth_interval, op.hysteresis, op.min_scale) == (
        2.0**16,
        2000,
        1,
        1.0,
    )


# --------------------------------------------------------------------------
# state_dict


def test_state_dict_round_trip_continues_like_paddle():
    config = dict(
        init_loss_scaling=2.0**10, decr_ratio=0.8, incr_every_n_steps=4, decr_every_n_nan_or_inf=3
    )
    policy = compat.paddle.GradScaler(**config)
    seq = SEQS[0]
    k = 117
    ours = run_policy(policy, seq[:k])
    last = jax.tree_util.tree_map(lambda x: jnp.asarray(x[-1]), ours)
    saved = compat.paddle.export_state(policy, last)
    ref = PaddleGradScaler(**config)
    for f in seq[:k]:
        ref.step(bool(f))
    assert sorted(saved) == sorted(
        [
            "scale",
            "incr_ratio",
            "decr_ratio",
            "incr_every_n_steps",
            "decr_every_n_nan_or_inf",
            "incr_count",
            "decr_count",
            "use_dynamic_loss_scaling",
        ]
    )
    assert saved["scale"].dtype == np.float32 and saved["scale"].shape == (1,)
    assert saved["scale"][0] == ref._scale
    assert (saved["incr_count"], saved["decr_count"]) == (ref._incr_count, ref._decr_count)
    assert (saved["incr_ratio"], saved["decr_ratio"]) == (2.0, 0.8)
    assert saved["use_dynamic_loss_scaling"] is True
    # load_state_dict: the reference resumes from the dict, ours from import_state.
    new_policy, state = compat.paddle.import_state(saved)
    rest = run_policy(new_policy, seq[k:], state=state)
    expected = [ref.step(bool(f))[0] for f in seq[k:]]
    np.testing.assert_array_equal(rest.scale, np.asarray(expected, np.float32))
    again = compat.paddle.export_state(new_policy, state)  # the import loses nothing
    assert again.keys() == saved.keys()
    assert all(np.array_equal(again[key], saved[key]) for key in saved)


def test_state_dict_static_and_disabled():
    static = compat.paddle.GradScaler(init_loss_scaling=64.0, use_dynamic_loss_scaling=False)
    d = compat.paddle.export_state(static, static.init())
    assert d["use_dynamic_loss_scaling"] is False and d["scale"][0] == 64.0
    policy, state = compat.paddle.import_state(d)
    assert policy == static and float(state.scale) == 64.0
    off = compat.paddle.GradScaler(enable=False)
    assert compat.paddle.export_state(off, off.init()) == {}
    with pytest.raises(ValueError, match="The input state dict is empty"):
        compat.paddle.import_state({})
    op = compat.paddle.update_loss_scaling()
    with pytest.raises(ValueError, match="no Paddle GradScaler equivalent"):
        compat.paddle.export_state(op, op.init())
    bad = dict(d, use_dynamic_loss_scaling=True, incr_count=2000)
    with pytest.raises(ValueError, match=r"incr_count must be in \[0, 1999\]"):
        compat.paddle.import_state(bad)


def test_grad_scaler_trains_in_one_trace():
    """In a jitted step: one trace over good and overflowing steps, float32 scale, int32 counts."""
    tx = lsj.loss_scaling(
        optax.sgd(0.1),
        compat.paddle.GradScaler(
            init_loss_scaling=8.0, incr_every_n_steps=2, decr_every_n_nan_or_inf=2
        ),
    )
    params = {"w": jnp.ones(2, jnp.float32)}
    state = tx.init(params)
    traces = []

    @jax.jit
    def step(params, state, g):
        traces.append(1)
        return lsj.apply_gradients(tx, {"w": g}, state, params)

    scales = []
    for bad in [False, False, True, True, False, True, False, False]:
        g = jnp.array([jnp.inf if bad else 0.5, 0.5], jnp.float32)
        params, state = step(params, state, g)
        ls = lsj.get_loss_scale_state(state)
        scales.append(float(ls.scale))
        assert ls.scale.dtype == jnp.float32 and ls.growth_count.dtype == jnp.int32
    assert len(traces) == 1
    assert scales == [8.0, 16.0, 16.0, 8.0, 8.0, 8.0, 8.0, 16.0]
