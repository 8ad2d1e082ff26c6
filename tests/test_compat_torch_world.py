"""fairseq's, metaseq's and Colossal-AI's scalers (``lossscale_jax.compat``), step for step.

Each is compared on seeded overflow sequences (bursts, long good runs, noise) with its rule
transcribed from upstream (``tests/reference_torch_world.py``); fairseq's and metaseq's own
optimizer test (``tests/test_fp16_optimizer.py``, metaseq ``gpu_tests/test_fp16_optimizer.py``:
Linear(1, 1), w=3, b=5, x=2, Adam lr 0.1) is re-expressed with its numbers. Colossal-AI has no
unit test of ``DynamicGradScaler``. One compile per configuration.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import FLOAT16_PARAMS, run_policy
from reference_scalers import comparable_prefix
from reference_torch_world import ColossalDynamicGradScaler, FairseqDynamicLossScaler

import lossscale_jax as lsj
from lossscale_jax import compat

F32 = np.float32
TINY = float(np.finfo(np.float32).tiny)
F32_MAX = float(np.finfo(np.float32).max)
N = 400


def _sequences():
    """Three seeded sequences of N flags: bursts with good runs, sparse noise, dense noise."""
    rng = np.random.default_rng(26)
    runs: list[bool] = []
    while len(runs) < N:
        runs += [True] * int(rng.integers(1, 9)) + [False] * int(rng.choice([1, 3, 7, 40]))
    return [
        np.asarray(runs[:N], bool),
        rng.random(N) < 0.05,
        rng.random(N) < 0.45,
    ]


SEQS = _sequences()


def _run(policy, make_reference):
    """Ours and the reference over each sequence from a fresh state (one compile: same length)."""
    out = []
    for seq in SEQS:
        ours = run_policy(policy, seq)
        ref = make_reference()
        steps = []
        for f in seq:  # fairseq stops training at FloatingPointError: so does the reference
            steps.append(ref.step(bool(f)))
            if getattr(ref, "raised", False):
                break
        out.append((ours, ref, steps))
    return out


# --------------------------------------------------------------------------
# fairseq


FAIRSEQ = [  # (config, reaches FloatingPointError, pinned at threshold)
    (dict(init_scale=2.0**-9, scale_window=4), True, False),
    (dict(init_scale=2.0**3, scale_window=3, threshold=2.0**-3), False, True),
    (
        dict(init_scale=2.0**15, scale_factor=4.0, scale_window=2, min_loss_scale=2.0**-20),
        True,
        False,
    ),
]


@pytest.mark.parametrize(("config", "raises", "pins"), FAIRSEQ)
def test_fairseq_matches_dynamic_loss_scaler(config, raises, pins):
    seen_raise = seen_pinned = False
    for ours, ref, steps in _run(
        compat.fairseq.DynamicLossScaler(**config), lambda: FairseqDynamicLossScaler(**config)
    ):
        n = len(steps)
        m = comparable_prefix([s for s, _ in steps], TINY, F32_MAX)  # float32's range
        np.testing.assert_array_equal(ours.scale[:m], [F32(s) for s, _ in steps[:m]])
        assert np.all(np.isfinite(ours.scale))  # a growth to inf is refused
        np.testing.assert_array_equal(ours.last_skipped[:n], [k for _, k in steps])
        # stuck: the step fairseq raises at, or an overflow that left the scale pinned at
        # threshold; the scale is kept in both.
        prev = np.concatenate([[F32(config["init_scale"])], ours.scale[:-1]])
        pinned = ours.last_overflow & (ours.scale >= prev)
        np.testing.assert_array_equal(ours.stuck[:n], pinned[:n])
        if ref.raised:
            seen_raise = True
            assert ours.stuck[n - 1] and ours.scale[n - 1] == prev[n - 1]
        seen_pinned |= bool(pinned[: n - 1 if ref.raised else n].any())
    assert (seen_raise, seen_pinned) == (raises, pins)


def test_fairseq_argument_errors():
    with pytest.raises(ValueError, match="tolerance must be a finite number"):
        compat.fairseq.DynamicLossScaler(tolerance=float("inf"))
    with pytest.raises(ValueError, match="scale_window must be an int >= 1"):
        compat.fairseq.DynamicLossScaler(scale_window=0)
    with pytest.raises(TypeError, match="scale_window must be an int"):
        compat.fairseq.DynamicLossScaler(scale_window=2.5)  # type: ignore[arg-type]


# tolerance > 0: a backoff only once the overflows since the last backoff reach `tolerance`
# times the iterations since the last rescale. (module, config)
TOLERANT = [
    ("fairseq", dict(init_scale=2.0**10, scale_window=8, tolerance=0.25)),
    ("fairseq", dict(init_scale=2.0**-2, scale_window=16, tolerance=0.1)),  # raises
    # fairseq's optimizer tests' config has tolerance 1; here with overflows.
    ("fairseq", dict(init_scale=8.0, scale_window=3, tolerance=1.0, threshold=2.0)),
    ("metaseq", dict(init_scale=4.0, scale_window=16, tolerance=0.2)),
    ("metaseq", dict(init_scale=2.0, scale_window=2, tolerance=0.5)),  # at its minimum
]
# A sequence where an overflow comes after 9 good iterations since a rescale: 1 / 10.0 is
# the float64 0.1 itself, so fairseq backs off at tolerance=0.1 (an exact rational or a
# float32 comparison could decide otherwise near the threshold; see test_ratio).
TIE = np.asarray(([False] * 9 + [True]) * 12 + [True] * 6, bool)


@pytest.mark.parametrize(
    ("name", "config"), TOLERANT, ids=[f"{n}-{i}" for i, (n, _) in enumerate(TOLERANT)]
)
def test_tolerance_matches_dynamic_loss_scaler(name, config):
    module = getattr(compat, name)
    cfg = {"min_loss_scale": 2.0**-5 if name == "metaseq" else 1e-4, **config}
    policy = module.DynamicLossScaler(**cfg)
    tolerated = backed_off = ties = 0
    for seq in [*SEQS, TIE]:
        ours = run_policy(policy, seq)
        ref = FairseqDynamicLossScaler(**cfg, metaseq=name == "metaseq")
        prev = F32(cfg["init_scale"])
        for t, flag in enumerate(seq):
            o_before = ref._overflows_since_rescale
            r_before = ref._iter - ref._last_rescale_iter
            scale, skipped = ref.step(bool(flag))
            assert ours.scale[t] == F32(scale), t
            assert ours.last_skipped[t] == skipped, t
            # stuck: the step fairseq raises at, or a backoff that left the scale where it was
            backoff = bool(flag) and ref._overflows_since_rescale == 0
            want_stuck = ref.raised or (backoff and F32(scale) >= prev)
            assert ours.stuck[t] == want_stuck, t
            if ref.raised:  # fairseq stops here; so does the comparison
                break
            own = ours.policy_state
            assert own["iter_since_rescale"][t] == ref._iter - ref._last_rescale_iter, t
            assert own["overflows_since_rescale"][t] == ref._overflows_since_rescale, t
            if name == "metaseq":
                assert ours.hysteresis_count[t] == ref.scale_window, t
            if flag:
                tolerated += not backoff
                backed_off += backoff
                ties += (o_before + 1) / float(r_before) == cfg["tolerance"]
            prev = F32(scale)
    assert tolerated and backed_off  # the rule's two outcomes both happened
    if cfg["tolerance"] == 0.1:
        assert ties  # and the float64 tie


@pytest.mark.slow  # about 1 s: a checkified step
def test_fairseq_floating_point_error_becomes_checkify_error():
    """With on_stuck="error" the step fairseq raises at is an error; the scale is kept."""
    policy = compat.fairseq.DynamicLossScaler(init_scale=2.0**-13, scale_window=8)
    tx = lsj.loss_scaling(optax.sgd(0.1), policy, on_stuck="error")
    params = {"w": jnp.ones(2, jnp.float32)}
    state = tx.init(params)
    bad = {"w": jnp.array([jnp.inf, 1.0], jnp.float32)}
    with pytest.raises(ValueError, match="loss scaling is stuck.*scale=0.0001220703125"):
        lsj.apply_gradients(tx, bad, state, params)
    fairseq = FairseqDynamicLossScaler(init_scale=2.0**-13, scale_window=8)
    fairseq.step(True)
    assert fairseq.raised and fairseq.loss_scale == 2.0**-13


# --------------------------------------------------------------------------
# fairseq's and metaseq's optimizer test: Linear(1, 1), one Adam step with an fp16 model.

X = jnp.float16(2.0)
TARGET = jnp.float16(2.0 * 3.0 + 5.0 + 1.0)


def _fairseq_adam(lr=0.1, b1=0.9, b2=0.999, eps=1e-8):
    """fairseq/optim/adam.py ``Adam.step`` in its own order (float32 state, Python-float
    step size), so the parameters come out bit for bit as upstream asserts them. First step
    only (the bias corrections of step 1), which is all the test takes."""

    def init(params):
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return (jnp.zeros([], jnp.int32), zeros, zeros)

    def update(grads, state, params):
        step, m, v = state
        step = step + 1
        m = jax.tree.map(lambda m, g: m * F32(b1) + g.astype(jnp.float32) * F32(1 - b1), m, grads)
        v = jax.tree.map(
            lambda v, g: v * F32(b2) + jnp.square(g.astype(jnp.float32)) * F32(1 - b2), v, grads
        )
        step_size = F32(lr * np.sqrt(1 - b2) / (1 - b1))  # step 1's: the test takes one

        def new(p, m, v):
            p32 = p.astype(jnp.float32) - step_size * (m / (jnp.sqrt(v) + F32(eps)))
            return p32.astype(p.dtype) - p

        return jax.tree.map(new, params, m, v), (step, m, v)

    return optax.GradientTransformation(init, update)


# The tests' config: fp16_init_scale=1, fp16_scale_window=1, threshold_loss_scale=1,
# min_loss_scale=1e-4, fp16_scale_tolerance=1.
TEST_CFG = dict(init_scale=1.0, scale_window=1, threshold=1.0, min_loss_scale=1e-4, tolerance=1.0)


def _l1(params):
    p16 = jax.tree.map(lambda a: a.astype(jnp.float16), params)
    return jnp.abs(X * p16["w"][0, 0] + p16["b"][0] - TARGET)


@FLOAT16_PARAMS
@pytest.mark.slow  # up to 2 s each: eager Adam steps
@pytest.mark.parametrize("module", [compat.fairseq, compat.metaseq], ids=["fairseq", "metaseq"])
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_upstream_fp16_optimizer_run_iter(module, memory_efficient):
    policy = module.DynamicLossScaler(**TEST_CFG)
    tx = lsj.loss_scaling(_fairseq_adam(), policy)
    dtype = jnp.float16 if memory_efficient else jnp.float32  # no fp32 master copy
    params = {"w": jnp.full((1, 1), 3.0, dtype), "b": jnp.full((1,), 5.0, dtype)}
    state = tx.init(params)
    loss = _l1(params)
    assert loss == jnp.float16(1.0)
    grads = jax.grad(lambda p: lsj.scale_loss(_l1(p), state))(params)
    grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
    grad_norm = grad_norm / lsj.metrics(state)["loss_scale"]
    np.testing.assert_allclose(float(grad_norm), 2.2361, atol=5e-5)
    params, state = lsj.apply_gradients(tx, grads, state, params)
    assert params["w"].astype(jnp.float16)[0, 0] == jnp.float16(3.0996)
    assert params["b"].astype(jnp.float16)[0] == jnp.float16(5.1016)
    if not memory_efficient:  # the fp32 params: exactly [3.1, 5.1]
        assert params["w"][0, 0] == F32(3.1) and params["b"][0] == F32(5.1)
    assert float(lsj.metrics(state)["loss_scale"]) == 2.0


@pytest.mark.parametrize("module", [compat.fairseq, compat.metaseq], ids=["fairseq", "metaseq"])
def test_state_dict_round_trip(module):
    """fairseq/metaseq save the scale alone (test_memory_efficient_fp16's reload)."""
    policy = module.DynamicLossScaler(**TEST_CFG)
    state = policy.adjust(policy.init(), False)
    saved = module.export_state(policy, state)
    assert saved == {"loss_scale": 2.0}
    again, restored = module.import_state({**saved, "state": {}}, **_without_init(TEST_CFG))
    assert float(restored.scale) == 2.0 and restored.scale.dtype == jnp.float32
    assert restored.growth_count.dtype == jnp.int32 and int(restored.growth_count) == 0
    assert module.export_state(again, restored) == saved
    other = compat.metaseq if module is compat.fairseq else compat.fairseq
    with pytest.raises(ValueError, match="has no .* equivalent"):
        other.export_state(policy, state)


def _without_init(cfg):
    return {k: v for k, v in cfg.items() if k != "init_scale"}


# --------------------------------------------------------------------------
# metaseq

METASEQ = [
    dict(),  # OPT's defaults: init 4, window 256, min 2**-5
    dict(init_scale=2.0, scale_window=2),  # the window hits 1 and detaches from the scale
    dict(init_scale=16.0, scale_window=4, scale_factor=4.0, threshold=0.25),
]


@pytest.mark.parametrize("config", METASEQ)
def test_metaseq_matches_dynamic_loss_scaler(config):
    cfg = {"init_scale": 4.0, "scale_window": 256, "min_loss_scale": 2.0**-5, **config}
    detached = False
    for ours, ref, steps in _run(
        compat.metaseq.DynamicLossScaler(**cfg),
        lambda: FairseqDynamicLossScaler(**cfg, metaseq=True),
    ):
        want = np.asarray([F32(s) for s, _ in steps], np.float32)
        np.testing.assert_array_equal(ours.scale, want)
        np.testing.assert_array_equal(ours.last_skipped, [k for _, k in steps])
        assert int(ours.hysteresis_count[-1]) == int(ref.scale_window)
        ratio = cfg["scale_window"] * want / F32(cfg["init_scale"])
        detached |= bool(np.any(np.abs(ours.hysteresis_count - ratio) > 0.5))
    assert detached  # the sequences reach the minimum, where the window leaves the scale


def test_metaseq_refuses_fractional_factor():
    with pytest.raises(ValueError, match="scale_factor must be a whole number"):
        compat.metaseq.DynamicLossScaler(scale_factor=1.5)


# --------------------------------------------------------------------------
# Colossal-AI

COLOSSAL = [
    dict(initial_scale=2.0**16, growth_interval=5, hysteresis=2),
    dict(initial_scale=2.0**8, growth_interval=3, hysteresis=3, min_scale=1.0, max_scale=2.0**10),
    dict(
        initial_scale=2.0**8,
        growth_factor=3,
        backoff_factor=0.25,
        growth_interval=2,
        hysteresis=0,
        min_scale=0.5,
    ),
]


@pytest.mark.parametrize("config", COLOSSAL)
def test_colossalai_matches_dynamic_grad_scaler(config):
    for ours, _, steps in _run(
        compat.colossalai.DynamicGradScaler(**config), lambda: ColossalDynamicGradScaler(**config)
    ):
        m = comparable_prefix([s for s, _ in steps], TINY, F32_MAX)  # Colossal-AI stores inf
        np.testing.assert_array_equal(ours.scale[:m], [s for s, _ in steps[:m]])
        assert np.all(np.isfinite(ours.scale))
        np.testing.assert_array_equal(ours.last_skipped, [k for _, k in steps])


def test_colossalai_state_dict():
    policy = compat.colossalai.DynamicGradScaler(initial_scale=512.0, min_scale=1.0)
    state = policy.adjust(policy.adjust(policy.init(), True), True)  # hysteresis 2: halved
    saved = compat.colossalai.export_state(policy, state)
    assert saved["scale"].tolist() == [256.0] and saved["hysteresis"] == 2
    assert (saved["growth_factor"], saved["backoff_factor"]) == (2.0, 0.5)
    again, restored = compat.colossalai.import_state(saved, min_scale=1.0)
    assert float(restored.scale) == 256.0 and again == compat.colossalai.DynamicGradScaler(
        initial_scale=256.0, min_scale=1.0
    )
    with pytest.raises(ValueError, match="min_scale must be > 0 and <= initial_scale"):
        compat.colossalai.DynamicGradScaler(initial_scale=1.0, min_scale=2.0)
