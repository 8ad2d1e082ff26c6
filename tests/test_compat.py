"""``lossscale_jax.compat``: every scaler's trajectory and skips equal the original, step for step.

References: the real library where it is a test dependency (jmp, Flax, Keras 3 with the JAX
backend) and otherwise the original update rule transcribed in ``reference_scalers.py``, which
names the source file of each. Sequences are >= 1,000 steps with bursts of overflows and long
good runs; each configuration compiles once (a ``lax.scan`` over the whole sequence).
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jmp as real_jmp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from flax.training import dynamic_scale as flax_dynamic_scale  # noqa: E402
from helpers import run_policy  # noqa: E402  (tests/ is on sys.path under pytest)
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from reference_scalers import (  # noqa: E402
    ApexLossScaler,
    ApexUpdateScaleHysteresis,
    CerebrasGradScaler,
    DeepSpeedDynamicLossScaler,
    DeepSpeedFP16Optimizer,
    DeepSpeedMinScaleError,
    MegatronDynamicGradScaler,
    MindSporeDynamicLossScaleUpdateCell,
    TF1ExponentialUpdate,
    TorchGradScaler,
    comparable_prefix,
)

import lossscale_jax as lsj  # noqa: E402
from lossscale_jax import compat  # noqa: E402

F32 = np.float32
TINY = float(np.finfo(np.float32).tiny)
F32_MAX = float(np.finfo(np.float32).max)
N = 1200  # steps per sequence (fixed, so one compile per configuration)


# --------------------------------------------------------------------------
# Overflow sequences: bursts of overflows and long good runs, or Bernoulli noise.


def _from_runs(args) -> np.ndarray:
    lead, runs = args
    seq = [False] * lead
    i = 0
    while len(seq) < N:
        bad, good = runs[i % len(runs)]
        seq += [True] * bad + [False] * good
        i += 1
    return np.asarray(seq[:N], bool)


_runs = st.tuples(
    st.integers(0, 100),
    st.lists(
        st.tuples(st.integers(1, 12), st.one_of(st.integers(1, 10), st.integers(50, 1500))),
        min_size=1,
        max_size=30,
    ),
).map(_from_runs)
_noise = st.tuples(st.integers(0, 2**32 - 1), st.sampled_from([0.0005, 0.01, 0.05, 0.15])).map(
    lambda t: np.random.default_rng(t[0]).random(N) < t[1]
)
sequences = st.one_of(_runs, _noise)


# --------------------------------------------------------------------------
# Runners: ours, and the real libraries, each one compile per configuration.


def ours(policy, seq):
    states = run_policy(policy, seq)
    return states.scale, states.last_skipped, states.stuck


def reference(ref, seq):
    out = [ref.step(bool(f)) for f in seq]
    return [s for s, _ in out], np.asarray([k for _, k in out], bool)


def assert_same(ours_scale, ours_skip, ref_scale, ref_skip, lo=TINY, hi=F32_MAX):
    """Equal scales and skips on every step while the reference stays in float32's range.

    Past that point (a reference scale of inf, or below ``2**-126`` where the original has no
    floor) this library deliberately stays in range; that is checked too.
    """
    n = comparable_prefix(ref_scale, lo, hi)
    want = np.asarray([F32(s) for s in ref_scale[:n]], np.float32)
    np.testing.assert_array_equal(ours_scale[:n], want)
    np.testing.assert_array_equal(ours_skip, ref_skip)
    assert np.all(np.isfinite(ours_scale)) and np.all(ours_scale >= F32(TINY))
    return n


# --------------------------------------------------------------------------
# Huawei Ascend npu_bridge / TF1 contrib.

NPU_CONFIGS = [
    # The npu_bridge example: init 2**32, grow every 1000, halve after 2 overflows.
    dict(init_loss_scale=2**32, incr_every_n_steps=1000, decr_every_n_nan_or_inf=2, decr_ratio=0.5),
    dict(init_loss_scale=2**15, incr_every_n_steps=7),  # defaults: decr 2, ratios 2 / 0.8
    dict(
        init_loss_scale=1000.0,
        incr_every_n_steps=1,
        decr_every_n_nan_or_inf=3,
        incr_ratio=1.5,
        decr_ratio=0.75,
    ),
]


@settings(max_examples=12)
@given(seq=sequences, config=st.sampled_from(NPU_CONFIGS))
def test_npu_exponential_update_matches_tf1_rule(seq, config):
    policy = compat.npu.ExponentialUpdateLossScaleManager(**config)
    scale, skip, _ = ours(policy, seq)
    ref = TF1ExponentialUpdate(**config, npu_bridge=True)
    n = assert_same(scale, skip, *reference(ref, seq), lo=1.0)
    assert n == N  # floor 1 and growth refused near float32's max: always comparable


def test_npu_growth_stops_at_npu_bridge_limit_not_at_float32_max():
    # npu_bridge grows while scale < float32(3.4e38 / incr_ratio); TF1 while the result is
    # finite. From 1.6e38 with ratio 2: npu_bridge grows once (1.6e38 < 1.7e38) to 3.2e38 and
    # stops; from float32 max / 2 (1.7014e38 >= 1.7e38) it refuses although 2 * that is finite.
    for init, want in [(1.6e38, F32(1.6e38) * 2), (F32_MAX / 2, F32(F32_MAX / 2))]:
        policy = compat.npu.ExponentialUpdateLossScaleManager(init, 1, incr_ratio=2)
        scale, _, _ = ours(policy, np.zeros(3, bool))
        np.testing.assert_array_equal(scale, [want] * 3)
        ref = TF1ExponentialUpdate(init, 1, incr_ratio=2, npu_bridge=True)
        np.testing.assert_array_equal(scale, reference(ref, np.zeros(3, bool))[0])
    tf1 = TF1ExponentialUpdate(F32_MAX / 2, 1, incr_ratio=2)  # TF1 contrib reaches the max
    assert reference(tf1, np.zeros(1, bool))[0][0] == F32(F32_MAX)


@settings(max_examples=5)
@given(seq=sequences, check=st.booleans())
def test_npu_fixed_manager_skips_only_with_overflow_check(seq, check):
    scale, skip, _ = ours(compat.npu.FixedLossScaleManager(2**10, enable_overflow_check=check), seq)
    np.testing.assert_array_equal(scale, np.full(N, 1024.0, np.float32))
    np.testing.assert_array_equal(skip, seq & check)


def _npu_example_tx():
    return compat.npu.NPULossScaleOptimizer(
        optax.adam(1e-3),
        compat.npu.ExponentialUpdateLossScaleManager(
            init_loss_scale=2**32,
            incr_every_n_steps=1000,
            decr_every_n_nan_or_inf=2,
            decr_ratio=0.5,
        ),
    )


def test_npu_optimizer_saturating_check_and_step_not_advanced():
    tx = _npu_example_tx()
    params = {"w": jnp.zeros(3, jnp.float32)}
    state = tx.init(params)
    saturated = {"w": jnp.array([1.0, 65504.0, 0.0], jnp.float16)}  # finite, but saturated
    nan = {"w": jnp.array([1.0, jnp.nan, 0.0], jnp.float16)}
    good = {"w": jnp.array([1.0, 2.0, 3.0], jnp.float16)}
    update = jax.jit(tx.update)
    ref = TF1ExponentialUpdate(2**32, 1000, 2, decr_ratio=0.5)
    for grads, bad in [(saturated, True), (nan, True), (good, False), (saturated, True)]:
        updates, state = update(grads, state, params)
        want_scale, _ = ref.step(bad)
        m = lsj.metrics(state)
        assert float(m["loss_scale"]) == float(want_scale)
        assert bool(m["skipped"]) == bad
        if bad:
            assert not np.any(np.asarray(updates["w"]))
    adam_count = state.inner_state[0].count
    assert int(adam_count) == 1  # only the good step advanced Adam


@pytest.mark.slow
def test_npu_optimizer_distributed_reduces_the_flag():
    tx = compat.npu.NPULossScaleOptimizer(
        optax.sgd(0.1),
        compat.npu.FixedLossScaleManager(128),
        is_distributed=True,
        axis_name="batch",
    )
    params = {"w": jnp.zeros(2, jnp.float32)}
    state = jax.tree_util.tree_map(lambda x: jnp.stack([x] * 4), tx.init(params))
    grads = {"w": jnp.ones((4, 2), jnp.float16).at[2, 0].set(65504.0)}  # one device saturates
    step = jax.vmap(lambda g, s: tx.update(g, s, params), axis_name="batch")
    updates, state = step(grads, state)
    assert np.all(np.asarray(state.loss_scale.last_skipped))  # every device skips
    assert not np.any(np.asarray(updates["w"]))


# --------------------------------------------------------------------------
# PyTorch GradScaler (transcribed: torch is not a test dependency).

TORCH_CONFIGS = [
    dict(),
    dict(growth_interval=5),
    dict(init_scale=2.0**10, growth_factor=1.5, backoff_factor=0.75, growth_interval=3),
    dict(init_scale=3.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=40),
]


@settings(max_examples=12)
@given(seq=sequences, config=st.sampled_from(TORCH_CONFIGS))
def test_torch_grad_scaler_matches_amp_update_scale(seq, config):
    scale, skip, _ = ours(compat.torch.GradScaler(**config), seq)
    assert_same(scale, skip, *reference(TorchGradScaler(**config), seq))


def test_torch_grad_scaler_disabled_is_no_scale():
    assert compat.torch.GradScaler(enabled=False) == lsj.NoScale()


# --------------------------------------------------------------------------
# NVIDIA apex.

APEX_CONFIGS = [
    dict(),
    dict(scale_window=6, min_loss_scale=1.0),
    dict(init_scale=2.0**30, scale_window=2, max_loss_scale=2.0**20, min_loss_scale=0.25),
    dict(init_scale=1000.0, scale_window=25, max_loss_scale=float("inf")),
]


@settings(max_examples=12)
@given(seq=sequences, config=st.sampled_from(APEX_CONFIGS))
def test_apex_loss_scaler_matches_update_scale(seq, config):
    scale, skip, _ = ours(compat.apex.LossScaler(**config), seq)
    assert_same(scale, skip, *reference(ApexLossScaler(**config), seq))


APEX_HYSTERESIS_CONFIGS = [
    (2.0**16, 2.0, 0.5, 10, 2),
    (1024.0, 1.0, 0.25, 3, 3),  # growth factor 1: apex's tests use it
    (4.0, 4.0, 0.5, 50, 1),
]


@settings(max_examples=8)
@given(seq=sequences, config=st.sampled_from(APEX_HYSTERESIS_CONFIGS))
def test_apex_update_scale_hysteresis_matches_kernel(seq, config):
    scale, skip, _ = ours(compat.apex.update_scale_hysteresis(*config), seq)
    assert_same(scale, skip, *reference(ApexUpdateScaleHysteresis(*config), seq))


def test_apex_static_scale_never_skips():
    policy = compat.apex.LossScaler(loss_scale=128.0)
    seq = np.array([False, True, True, False])
    scale, skip, _ = ours(policy, seq)
    ref_scale, ref_skip = reference(ApexLossScaler(loss_scale=128.0), seq)
    np.testing.assert_array_equal(scale, np.float32(ref_scale))
    np.testing.assert_array_equal(skip, ref_skip)


# --------------------------------------------------------------------------
# DeepSpeed.

DEEPSPEED_CONFIGS = [
    dict(),
    dict(scale_window=8, delayed_shift=2),
    dict(scale_window=8, delayed_shift=3, consecutive_hysteresis=True),
    dict(
        init_scale=2.0**8,
        scale_factor=4.0,
        scale_window=3,
        min_scale=2.0,
        delayed_shift=2,
        raise_error_at_min_scale=False,
    ),
    dict(
        init_scale=2.0**4,
        scale_window=50,
        delayed_shift=2,
        consecutive_hysteresis=True,
        raise_error_at_min_scale=False,
    ),
]


@settings(max_examples=15)
@given(seq=sequences, config=st.sampled_from(DEEPSPEED_CONFIGS))
def test_deepspeed_dynamic_loss_scaler_matches_update_scale(seq, config):
    scale, skip, stuck = ours(compat.deepspeed.DynamicLossScaler(**config), seq)
    ref = DeepSpeedDynamicLossScaler(**config)
    ref_scale, ref_skip, would_raise = [], [], []
    for f in seq:
        would_raise.append(ref.would_raise(bool(f)))
        try:
            s, k = ref.step(bool(f))
        except DeepSpeedMinScaleError:
            break  # DeepSpeed stops here; this library flags `stuck` at this very step
        ref_scale.append(s)
        ref_skip.append(k)
    n = len(ref_scale)
    # `stuck` is DeepSpeed's raise condition, step for step (and the run ends at the raise).
    np.testing.assert_array_equal(stuck[: len(would_raise)], would_raise)
    if n < N:
        assert config.get("raise_error_at_min_scale", True) and stuck[n]
    m = comparable_prefix(ref_scale, TINY, F32_MAX)
    np.testing.assert_array_equal(scale[:m], np.float32(ref_scale[:m]))
    np.testing.assert_array_equal(skip[:n], ref_skip)


FP16_OPTIMIZER_CONFIGS = [
    dict(init_scale=2.0**8, scale_window=2, min_scale=1),
    dict(init_scale=2.0**16, scale_window=1000, min_scale=0.25),  # FP16_UnfusedOptimizer's
    dict(init_scale=4.0, scale_window=1, min_scale=1),
]


@settings(max_examples=8)
@given(seq=sequences, config=st.sampled_from(FP16_OPTIMIZER_CONFIGS))
def test_deepspeed_fp16_optimizer_matches_update_scale(seq, config):
    policy = compat.deepspeed.fp16_optimizer_policy(
        dynamic_loss_scale=True, dynamic_loss_args=config
    )
    scale, skip, _ = ours(policy, seq)
    ref = DeepSpeedFP16Optimizer(config["init_scale"], config["scale_window"], config["min_scale"])
    assert_same(scale, skip, *reference(ref, seq))


def test_deepspeed_fp16_optimizer_static_scale_skips():
    tx = compat.deepspeed.FP16_Optimizer(optax.sgd(1.0), static_loss_scale=128.0)
    params = {"w": jnp.zeros(2, jnp.float32)}
    updates, state = tx.update(
        {"w": jnp.array([jnp.inf, 1.0], jnp.float16)}, tx.init(params), params
    )
    assert bool(state.loss_scale.last_skipped) and float(state.loss_scale.scale) == 128.0
    assert not np.any(np.asarray(updates["w"]))


def test_deepspeed_raise_becomes_checkify_error():
    from jax.experimental import checkify

    policy = compat.deepspeed.DynamicLossScaler(init_scale=2.0, min_scale=1)
    tx = lsj.loss_scaling(optax.sgd(0.1), policy, on_stuck="error")
    params = {"w": jnp.zeros(2, jnp.float32)}
    state = tx.init(params)
    bad = {"w": jnp.array([jnp.inf, 0.0], jnp.float16)}
    step = jax.jit(checkify.checkify(lambda g, s: tx.update(g, s, params)))
    err, (_, state) = step(bad, state)  # 2 -> 1: no raise in DeepSpeed
    assert err.get() is None and float(lsj.metrics(state)["loss_scale"]) == 1.0
    err, (updates, state) = step(bad, state)  # at 1: DeepSpeed raises
    assert err.get() is not None and bool(lsj.metrics(state)["stuck"])
    assert not np.any(np.asarray(updates["w"]))  # skipped, nothing poisoned


# --------------------------------------------------------------------------
# Megatron-LM.

MEGATRON_CONFIGS = [
    dict(
        initial_scale=2.0**32,
        min_scale=1.0,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=1000,
        hysteresis=2,
    ),
    dict(
        initial_scale=2.0**16,
        min_scale=1.0,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=5,
        hysteresis=3,
    ),
    dict(
        initial_scale=4096.0,
        min_scale=0.5,
        growth_factor=1.5,
        backoff_factor=0.8,
        growth_interval=2,
        hysteresis=1,
    ),
]


@settings(max_examples=12)
@given(seq=sequences, config=st.sampled_from(MEGATRON_CONFIGS))
def test_megatron_dynamic_grad_scaler_matches_update(seq, config):
    scale, skip, _ = ours(compat.megatron.DynamicGradScaler(**config), seq)
    assert_same(scale, skip, *reference(MegatronDynamicGradScaler(**config), seq))


# --------------------------------------------------------------------------
# Keras 3 (the real library, JAX backend).


@functools.cache
def _keras_runner(initial_scale, dynamic_growth_steps):
    keras = pytest.importorskip("keras")
    assert keras.backend.backend() == "jax"
    opt = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        initial_scale=initial_scale,
        dynamic_growth_steps=dynamic_growth_steps,
    )
    var = keras.Variable(np.zeros((), np.float32))
    opt.build([var])
    idx = [i for i, v in enumerate(opt.variables) if v is opt.dynamic_scale]
    inner_it = [i for i, v in enumerate(opt.variables) if v is opt.inner_optimizer.iterations]
    assert len(idx) == 1 and len(inner_it) == 1

    @jax.jit
    def run(flags):
        def body(carry, f):
            tv, opt_vars = carry
            grad = jnp.where(f, jnp.inf, 1.0).astype(jnp.float32)
            new_tv, new_vars = opt.stateless_apply(opt_vars, [grad], tv)
            # Skipped: the inner optimizer's iteration count did not advance.
            skipped = new_vars[inner_it[0]] == opt_vars[inner_it[0]]
            return (new_tv, new_vars), (new_vars[idx[0]], skipped)

        init = ([var.value], [v.value for v in opt.variables])
        return jax.lax.scan(body, init, flags)[1]

    return run


KERAS_CONFIGS = [(2.0**15, 2000), (2.0**15, 6), (1.0, 1)]


@pytest.mark.slow
@settings(max_examples=10)
@given(seq=sequences, config=st.sampled_from(KERAS_CONFIGS))
def test_keras_loss_scale_optimizer_matches_keras(seq, config):
    initial_scale, steps = config
    keras_scale, keras_unchanged = _keras_runner(initial_scale, steps)(jnp.asarray(seq))
    keras_scale = np.asarray(keras_scale)
    keras_skip = np.asarray(keras_unchanged)
    scale, skip = _run_tx(_keras_tx(initial_scale, steps), jnp.asarray(seq))
    assert_same(np.asarray(scale), np.asarray(skip), list(keras_scale), keras_skip)


@functools.cache
def _keras_tx(initial_scale, steps):
    return _Hashable(compat.keras.LossScaleOptimizer(optax.sgd(0.1), initial_scale, steps))


@functools.partial(jax.jit, static_argnums=0)
def _run_tx(tx, flags):
    params = {"w": jnp.zeros(2, jnp.float32)}

    def body(state, f):
        g = jnp.where(f, jnp.array([jnp.inf, 1.0]), jnp.array([1.0, 1.0])).astype(jnp.float16)
        _, state = tx.update({"w": g}, state, params)
        s = lsj.get_loss_scale_state(state)
        return state, (s.scale, s.last_skipped)

    return jax.lax.scan(body, tx.init(params), flags)[1]


class _Hashable:
    """Wraps a transformation so it can be a static jit argument (identity hash)."""

    def __init__(self, tx):
        self.tx = tx

    def __getattr__(self, name):
        return getattr(self.tx, name)


# --------------------------------------------------------------------------
# Cerebras.

CEREBRAS_CONFIGS = [
    dict(loss_scale="dynamic"),
    dict(loss_scale="dynamic", steps_per_increase=6),
    dict(loss_scale="dynamic", steps_per_increase=4, overflow_tolerance=0.25),
    dict(
        loss_scale="dynamic",
        init_scale=2.0**10,
        steps_per_increase=20,
        overflow_tolerance=0.05,
        min_loss_scale=1.0,
        max_loss_scale=2.0**20,
    ),
    dict(loss_scale="dynamic", init_scale=2.0**-20, steps_per_increase=2, overflow_tolerance=0.5),
]


@settings(max_examples=15)
@given(seq=sequences, config=st.sampled_from(CEREBRAS_CONFIGS))
def test_cerebras_grad_scaler_matches_update_scale(seq, config):
    scale, skip, _ = ours(compat.cstorch.GradScaler(**config), seq)
    kwargs = {k: v for k, v in config.items() if k != "loss_scale"}
    n = assert_same(scale, skip, *reference(CerebrasGradScaler(**kwargs), seq))
    assert n == N  # clamped to [min, max] every step: always comparable


def test_cerebras_static_scale_never_skips():
    scale, skip, _ = ours(compat.cstorch.GradScaler(loss_scale=512.0), np.array([True, False]))
    np.testing.assert_array_equal(scale, [512.0, 512.0])
    assert not skip.any()


def test_cerebras_optimizer_step_clips_like_clip_grad_norm():
    tx = compat.cstorch.optimizer_step(
        optax.sgd(1.0),
        compat.cstorch.GradScaler(loss_scale="dynamic", init_scale=4.0),
        max_gradient_norm=1.0,
    )
    params = {"a": jnp.zeros(2, jnp.float32), "b": jnp.zeros(1, jnp.float32)}
    state = tx.init(params)
    g = {"a": jnp.array([3.0, 0.0], jnp.float32), "b": jnp.array([4.0], jnp.float32)}
    scaled = jax.tree_util.tree_map(lambda x: (x * 4.0).astype(jnp.float16), g)
    updates, state = jax.jit(tx.update)(scaled, state, params)
    coef = np.float32(1.0) / (np.float32(5.0) + np.float32(1e-6))  # torch clip_grad_norm_
    np.testing.assert_array_equal(np.asarray(updates["a"]), -np.float32([3.0, 0.0]) * coef)
    np.testing.assert_array_equal(np.asarray(updates["b"]), -np.float32([4.0]) * coef)


# --------------------------------------------------------------------------
# MindSpore.

MINDSPORE_CONFIGS = [
    dict(),
    dict(init_loss_scale=2.0**10, scale_window=7),
    dict(init_loss_scale=1000.0, scale_factor=3, scale_window=2),
    dict(init_loss_scale=2.0**100, scale_factor=4, scale_window=1),
]


@settings(max_examples=12)
@given(seq=sequences, config=st.sampled_from(MINDSPORE_CONFIGS))
def test_mindspore_dynamic_manager_matches_update_cell(seq, config):
    scale, skip, _ = ours(compat.mindspore.DynamicLossScaleManager(**config), seq)
    args = dict(
        loss_scale_value=config.get("init_loss_scale", 2**24),
        scale_factor=config.get("scale_factor", 2),
        scale_window=config.get("scale_window", 2000),
    )
    assert_same(scale, skip, *reference(MindSporeDynamicLossScaleUpdateCell(**args), seq), lo=1.0)


@pytest.mark.parametrize("drop", [True, False])
def test_mindspore_fixed_manager(drop):
    seq = np.array([False, True, True])
    scale, skip, _ = ours(compat.mindspore.FixedLossScaleManager(256, drop), seq)
    np.testing.assert_array_equal(scale, [256.0] * 3)
    np.testing.assert_array_equal(skip, seq & drop)


# --------------------------------------------------------------------------
# jmp (the real library).

JMP_CONFIGS = [
    (2.0**15, 2000, 2, 1.0),
    (2.0**15, 5, 2, 1.0),
    (2.0**4, 3, 4, 2.0**-3),
    (2.0**120, 2, 2, 2.0**10),
]


@functools.partial(jax.jit, static_argnums=(1, 2))
def _run_jmp(loss_scale, period, factor, min_loss_scale, flags):
    # jmp's pytree flattening drops min_loss_scale, so the object is rebuilt each step
    # around the carried arrays; adjust() itself is jmp's own code.
    def body(carry, f):
        ls, counter = carry
        obj = real_jmp.DynamicLossScale(ls, counter, period, factor, min_loss_scale)
        new = obj.adjust(jnp.logical_not(f))
        return (new.loss_scale, new.counter), new.loss_scale

    init = (jnp.asarray(loss_scale, jnp.float32), jnp.zeros([], jnp.int32))
    return jax.lax.scan(body, init, flags)[1]


@settings(max_examples=12)
@given(seq=sequences, config=st.sampled_from(JMP_CONFIGS))
def test_jmp_dynamic_loss_scale_matches_jmp(seq, config):
    loss_scale, period, factor, min_ls = config
    policy = compat.jmp.dynamic_loss_scale_policy(
        jnp.asarray(loss_scale),
        period=period,
        factor=factor,
        min_loss_scale=jnp.asarray(min_ls, jnp.float32),
    )
    scale, skip, _ = ours(policy, seq)
    ref = np.asarray(_run_jmp(loss_scale, period, factor, jnp.float32(min_ls), jnp.asarray(seq)))
    assert_same(scale, skip, list(ref), seq)  # jmp's user code skips when not grads_finite


# --------------------------------------------------------------------------
# Flax (the real library).

FLAX_CONFIGS = [
    dict(),
    dict(growth_interval=4),
    dict(growth_interval=0, scale=2.0**100),
    dict(growth_interval=3, growth_factor=3.0, backoff_factor=0.75, scale=10.0, minimum_scale=0.5),
]


@functools.cache
def _flax_runner(growth_factor, backoff_factor, growth_interval, minimum_scale):
    @jax.jit
    def run(scale, flags):
        ds = flax_dynamic_scale.DynamicScale(
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            fin_steps=jnp.zeros([], jnp.int32),
            scale=jnp.asarray(scale, jnp.float32),
            minimum_scale=minimum_scale,
        )

        def body(ds, f):
            fun = lambda p: jnp.where(f, jnp.inf, 1.0) * p  # noqa: E731
            new_ds, is_finite, _, _ = ds.value_and_grad(fun)(jnp.float32(1.0))
            return new_ds, (new_ds.scale, jnp.logical_not(is_finite))

        return jax.lax.scan(body, ds, flags)[1]

    return run


@settings(max_examples=12)
@given(seq=sequences, config=st.sampled_from(FLAX_CONFIGS))
def test_flax_dynamic_scale_matches_flax(seq, config):
    full = (
        dict(
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=2000,
            scale=65536.0,
            minimum_scale=TINY,
        )
        | config
    )
    scale, skip, _ = ours(compat.flax.dynamic_scale_policy(**full), seq)
    run = _flax_runner(
        full["growth_factor"],
        full["backoff_factor"],
        full["growth_interval"],
        full["minimum_scale"],
    )
    ref_scale, ref_skip = run(full["scale"], jnp.asarray(seq))
    n = assert_same(scale, skip, list(np.asarray(ref_scale)), np.asarray(ref_skip))
    assert n == N


def test_flax_grows_one_step_later_than_torch():
    seq = np.zeros(4, bool)
    flax_scale, _, _ = ours(compat.flax.dynamic_scale_policy(growth_interval=2, scale=8.0), seq)
    torch_scale, _, _ = ours(compat.torch.GradScaler(init_scale=8.0, growth_interval=2), seq)
    np.testing.assert_array_equal(torch_scale, [8, 16, 16, 32])
    np.testing.assert_array_equal(flax_scale, [8, 8, 16, 16])


# --------------------------------------------------------------------------
# The constructors reject what the originals reject, in the originals' words.


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: compat.npu.FixedLossScaleManager(0.5), "loss_scale must be at least 1"),
        (lambda: compat.npu.FixedLossScaleManager("8"), "loss_scale must be a real number"),
        (lambda: compat.npu.ExponentialUpdateLossScaleManager(0.5, 10), "init_loss_scale"),
        (lambda: compat.npu.ExponentialUpdateLossScaleManager(2.0**15, 0), "incr_every_n_steps"),
        (
            lambda: compat.npu.ExponentialUpdateLossScaleManager(2.0**15, 10, 0),
            "decr_every_n_nan_or_inf",
        ),
        (
            lambda: compat.npu.ExponentialUpdateLossScaleManager(2.0**15, 10, decr_ratio=1.5),
            "decr_ratio",
        ),
        (lambda: compat.npu.NPULossScaleOptimizer(optax.sgd(1.0), "manager"), "loss_scale_manager"),
        (
            lambda: compat.npu.NPULossScaleOptimizer(
                optax.sgd(1.0), compat.npu.FixedLossScaleManager(8), is_distributed=True
            ),
            "axis_name",
        ),
        (lambda: compat.torch.GradScaler(growth_factor=1.0), "growth factor must be > 1.0"),
        (lambda: compat.torch.GradScaler(backoff_factor=1.0), "backoff factor must be < 1.0"),
        (lambda: compat.apex.LossScaler(loss_scale="static"), "loss_scale"),
        (lambda: compat.apex.LossScaler(scale_window=0), "scale_window"),
        (lambda: compat.deepspeed.DynamicLossScaler(scale_window=0), "scale_window"),
        (lambda: compat.deepspeed.DynamicLossScaler(delayed_shift=0), "delayed_shift"),
        (
            lambda: compat.deepspeed.DynamicLossScaler(raise_error_at_min_scale=1),
            "raise_error_at_min_scale",
        ),
        (lambda: compat.megatron.DynamicGradScaler(1.0, 0.0, 2.0, 0.5, 10, 1), "min_scale"),
        (lambda: compat.megatron.DynamicGradScaler(1.0, 2.0, 2.0, 0.5, 10, 1), "initial_scale"),
        (lambda: compat.megatron.DynamicGradScaler(8.0, 1.0, 1.0, 0.5, 10, 1), "growth_factor"),
        (lambda: compat.megatron.DynamicGradScaler(8.0, 1.0, 2.0, 1.0, 10, 1), "backoff_factor"),
        (lambda: compat.megatron.DynamicGradScaler(8.0, 1.0, 2.0, 0.5, 0, 1), "growth_interval"),
        (lambda: compat.megatron.DynamicGradScaler(8.0, 1.0, 2.0, 0.5, 10, 0), "hysteresis"),
        (
            lambda: compat.keras.LossScaleOptimizer(optax.sgd(1.0), dynamic_growth_steps=0),
            "dynamic_growth_steps",
        ),
        (
            lambda: compat.cstorch.GradScaler(loss_scale="dynamic", min_loss_scale=2.0**-20),
            "min_loss_scale too small",
        ),
        (
            lambda: compat.cstorch.GradScaler(loss_scale="dynamic", overflow_tolerance=-0.1),
            "overflow_tolerance",
        ),
        (
            lambda: compat.cstorch.GradScaler(loss_scale="dynamic", max_gradient_norm=1.0),
            "optimizer_step",
        ),
        (
            lambda: compat.cstorch.optimizer_step(
                optax.sgd(1.0), compat.cstorch.GradScaler(), max_gradient_norm=-1.0
            ),
            "non-negative",
        ),
        (
            lambda: compat.cstorch.optimizer_step(
                optax.sgd(1.0),
                compat.cstorch.GradScaler(),
                max_gradient_norm=1.0,
                max_gradient_value=1.0,
            ),
            "not both",
        ),
        (
            lambda: compat.mindspore.DynamicLossScaleManager(init_loss_scale=0.5),
            "init_loss_scale must be >= 1",
        ),
        (lambda: compat.mindspore.DynamicLossScaleManager(scale_factor=0), "scale_factor"),
        (lambda: compat.mindspore.DynamicLossScaleManager(scale_window=0), "scale_window"),
        (lambda: compat.mindspore.FixedLossScaleManager(0.5), "loss_scale must be >= 1"),
        (lambda: compat.jmp.dynamic_loss_scale_policy(jnp.ones(3)), "loss_scale"),
        (lambda: compat.jmp.dynamic_loss_scale_policy(2.0**15, period=0), "period"),
        (
            lambda: compat.jmp.dynamic_loss_scale_policy(2.0**15, period=5.5),
            "period must be a whole",
        ),
        (
            lambda: compat.jmp.dynamic_loss_scale_policy(2.0**15, 5, period=5),
            r"counter must be in \[0, period\)",
        ),
        (
            lambda: compat.jmp.dynamic_loss_scale_policy(2.0**15, min_loss_scale=-1.0),
            "min_loss_scale must be >= 0",
        ),
        (
            lambda: compat.apex.update_scale_hysteresis(8.0, 0.5, 0.5, 10, 2),
            "growth_factor must be >= 1",
        ),
        (
            lambda: compat.deepspeed.FP16_Optimizer(
                optax.sgd(1.0), dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 8}
            ),
            "missing",
        ),
        (
            lambda: compat.deepspeed.fp16_optimizer_policy(initial_dynamic_scale=8.0, unfused=True),
            "initial_dynamic_scale is not an argument of FP16_UnfusedOptimizer",
        ),
        (lambda: compat.keras.LossScaleOptimizer(optax.sgd(1.0), foo=1), "arguments: `foo`"),
        (lambda: compat.flax.dynamic_scale_policy(growth_interval=-1), "growth_interval"),
        (lambda: compat.flax.dynamic_scale_policy(backoff_factor=2.0), "backoff_factor"),
    ],
)
def test_constructors_reject_bad_arguments(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()


def test_each_framework_is_a_module_of_the_compat_package():
    import importlib

    frameworks = ["apex", "cstorch", "deepspeed", "flax", "jmp", "keras", "megatron"]
    frameworks += ["mindspore", "npu", "torch", "fairseq", "metaseq", "colossalai", "paddle"]
    frameworks += ["mpx"]  # loaded on first use: it imports Equinox
    assert sorted(compat.__all__) == sorted(frameworks)
    for name in frameworks:
        module = importlib.import_module(f"lossscale_jax.compat.{name}")
        assert getattr(compat, name) is module
    assert compat.npu.ExponentialUpdateLossScaleManager.__module__ == "lossscale_jax.compat.npu"
    with pytest.raises(TypeError, match="not callable"):
        compat.torch()


# --------------------------------------------------------------------------
# The policy extensions on their own.


def test_sticky_hysteresis_backs_off_on_every_overflow_until_growth():
    policy = lsj.DynamicScale(
        init_scale=64.0,
        growth_interval=3,
        hysteresis=2,
        consecutive_hysteresis=False,
        sticky_hysteresis=True,
    )
    seq = [True, True, True, False, True, False, False, False, True]
    #      h=1   back32 back16 good  back8 good   good   grow16 h=1
    scale, _, _ = ours(policy, np.asarray(seq))
    np.testing.assert_array_equal(scale, [64, 32, 16, 16, 8, 8, 8, 16, 16])


def test_growth_overflow_clamp_reaches_float32_max():
    big = 2.0**127
    clamp = lsj.DynamicScale(
        init_scale=big, growth_interval=1, max_scale=F32_MAX, growth_overflow="clamp"
    )
    refuse = lsj.DynamicScale(init_scale=big, growth_interval=1, max_scale=F32_MAX)
    assert ours(clamp, np.zeros(1, bool))[0][0] == F32(F32_MAX)
    assert ours(refuse, np.zeros(1, bool))[0][0] == F32(big)
    with pytest.raises(ValueError, match="growth_overflow"):
        lsj.DynamicScale(growth_overflow="clamp", max_scale=float("inf"))
    with pytest.raises(ValueError, match="growth_overflow"):
        lsj.DynamicScale(growth_overflow="wrap")


def test_tolerant_dynamic_scale_traces_once_and_keeps_dtypes():
    policy = lsj.TolerantDynamicScale(init_scale=8.0, overflow_tolerance=0.1, growth_interval=3)
    traces = []

    @jax.jit
    def step(s, f):
        traces.append(1)
        return policy.adjust(s, f)

    s = policy.init()
    for f in [True, False, False, True]:
        s = step(s, jnp.asarray(f))
    assert len(traces) == 1
    assert s.scale.dtype == jnp.float32 and s.growth_count.dtype == jnp.int32
    with pytest.raises(ValueError, match="overflow_tolerance"):
        lsj.TolerantDynamicScale(overflow_tolerance=1.5)


# --------------------------------------------------------------------------
# The compat-only policies and multi_optimizer: one trace, no host transfer, dtypes kept.


@pytest.mark.parametrize(
    "policy",
    [
        compat.npu.ExponentialUpdateLossScaleManager(2.0**32, 3),
        compat.deepspeed.fp16_optimizer_policy(dynamic_loss_scale=True),
        compat.apex.update_scale_hysteresis(2.0**16, 1.0, 0.5, 3, 2),
        compat.jmp.dynamic_loss_scale_policy(2.0**15, 2, period=3),
    ],
    ids=["npu", "deepspeed_fp16", "apex_kernel", "jmp_counter"],
)
def test_compat_policies_trace_once_without_host_transfer(policy):
    traces = []

    @jax.jit
    def step(s, f):
        traces.append(1)
        return policy.adjust(s, f)

    s = policy.init()
    flags = [jnp.asarray(f) for f in (True, False, False, True, False, False, False)]
    with jax.transfer_guard("disallow"):
        for f in flags:
            s = step(s, f)
    assert len(traces) == 1
    for a, b in zip(
        jax.tree_util.tree_leaves(s), jax.tree_util.tree_leaves(policy.init()), strict=True
    ):
        assert a.dtype == b.dtype and a.shape == b.shape


def test_multi_optimizer_traces_once_without_host_transfer_and_keeps_dtypes():
    params = {"a": jnp.zeros(3, jnp.float32), "b": jnp.zeros(2, jnp.bfloat16)}
    tx = compat.torch.multi_optimizer(
        {"x": optax.adam(1e-3), "y": optax.sgd(0.1)},
        {"a": "x", "b": "y"},
        compat.torch.GradScaler(),
    )
    traces = []

    @jax.jit
    def step(grads, state):
        traces.append(1)
        return tx.update(grads, state, params)

    state = tx.init(params)
    good = {"a": jnp.ones(3, jnp.float16), "b": jnp.ones(2, jnp.float16)}
    bad = {"a": jnp.ones(3, jnp.float16), "b": jnp.array([jnp.inf, 1.0], jnp.float16)}
    with jax.transfer_guard("disallow"):
        for g in (good, bad, good):
            updates, state = step(g, state)
    assert len(traces) == 1
    assert updates["a"].dtype == jnp.float32 and updates["b"].dtype == jnp.bfloat16
    assert float(state.loss_scale.scale) == 2.0**15 and int(state.loss_scale.skipped_steps) == 1
