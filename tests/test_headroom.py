"""HeadroomScale: the rule against a NumPy model, the range measured in the check's own pass,
one collective under pmap/shard_map, every overflow mode, accumulation, state and bounds."""

from __future__ import annotations

import math
import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization
from helpers import (  # tests/ is on sys.path under pytest
    assert_bits_equal,
    assert_no_host_round_trip,
    assert_step_within_ulps,
    import_benchmark,
    programs_round_alike,
    replicate,
)
from hypothesis import given, settings
from reference_scalers import ReferenceHeadroom

import lossscale_jax as lsj

F16_MAX = 65504.0
f32 = np.float32


# --------------------------------------------------------------------------
# The NumPy model of the rule: ``reference_scalers.ReferenceHeadroom`` (plain Python on
# np.float32 scalars), written from the docstring's pseudocode, independent of the JAX code.


def model_init(p: lsj.HeadroomScale) -> ReferenceHeadroom:
    return ReferenceHeadroom(p)


def model_step(p: lsj.HeadroomScale, s: ReferenceHeadroom, overflow: bool, amax: float):
    s.step(overflow, amax)
    return s


POLICIES = {
    "default": lsj.HeadroomScale(),
    "tight": lsj.HeadroomScale(
        init_scale=2.0**20,
        min_margin=0,
        max_margin=3,
        margin_interval=4,
        window=3,
        blind_backoff=0.25,
        min_scale=2.0**-4,
        max_scale=2.0**30,
    ),
    "unbounded": lsj.HeadroomScale(init_scale=3.0, min_margin=2, window=1, max_scale=math.inf),
}
STEPS = 48


@pytest.fixture(scope="module")
def scanned():
    """One compiled scan of ``adjust`` per policy (hypothesis reuses them)."""

    def make(policy):
        def run(overflow, amax):
            def body(s, x):
                s = policy.adjust(s, x[0], amax=x[1])
                return s, (s.scale, s.range_peak, s.margin, s.growth_count, s.last_skipped)

            return jax.lax.scan(body, policy.init(), (overflow, amax))[1]

        return jax.jit(run)

    return {k: make(p) for k, p in POLICIES.items()}


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(sorted(POLICIES)),
    over=st.lists(st.booleans(), min_size=STEPS, max_size=STEPS),
    exps=st.lists(st.floats(-60.0, 4.0), min_size=STEPS, max_size=STEPS),
    zeros=st.lists(st.integers(0, 30), min_size=STEPS, max_size=STEPS),
)
def test_rule_matches_the_numpy_model(scanned, name, over, exps, zeros):
    policy = POLICIES[name]
    # amax: powers of two and in between, some exact zeros (all-zero gradients), some inf/nan
    # on overflowing steps (what an overflowing check measures, ignored by the rule).
    amax = np.exp2(np.asarray(exps)).astype(np.float32)
    amax[np.asarray(zeros) == 0] = 0.0
    over_a = np.asarray(over)
    amax[over_a] = np.where(np.arange(STEPS)[over_a] % 2 == 0, np.inf, np.nan)
    got = jax.device_get(scanned[name](jnp.asarray(over_a), jnp.asarray(amax)))
    s = model_init(policy)
    for t in range(STEPS):
        s = model_step(policy, s, bool(over_a[t]), float(amax[t]))
        assert got[0][t] == s.scale, (t, "scale")
        assert got[1][t] == s.peak, (t, "peak")
        assert got[2][t] == s.margin, (t, "margin")
        assert got[3][t] == s.good, (t, "growth_count")
        assert bool(got[4][t]) == bool(over_a[t]), (t, "skipped")


def test_worked_example_from_the_docstring():
    # Hand-derived: room for 2**20 at scale 1, one octave of margin -> 2**19; an overflow
    # at 2**19 widens the margin to 2: 2**(20 - 2) = 2**18 (the peak is the measured one);
    # after margin_interval good steps at the same range the octave comes back -> 2**19.
    p = lsj.HeadroomScale(init_scale=2.0**10, margin_interval=3, window=1000)
    a = jnp.float32(2.0**-20)
    s = p.adjust(p.init(), False, amax=a)
    assert float(s.scale) == 2.0**19 and int(s.margin) == 1
    s = p.adjust(s, True, amax=jnp.float32(jnp.inf))
    assert float(s.scale) == 2.0**18 and int(s.margin) == 2 and bool(s.last_skipped)
    assert float(s.range_peak) == 2.0**-20
    for _ in range(2):
        s = p.adjust(s, False, amax=a)
        assert float(s.scale) == 2.0**18
    s = p.adjust(s, False, amax=a)
    assert float(s.scale) == 2.0**19 and int(s.margin) == 1
    # With the margin spent (max_margin), an overflow enters 1 / scale into the peak: the
    # scale cannot jump back to the one that overflowed at the next good step.
    q = lsj.HeadroomScale(init_scale=2.0**10, max_margin=1, window=1000)
    t = q.adjust(q.init(), False, amax=a)  # 2**19
    t = q.adjust(t, True, amax=jnp.float32(jnp.inf))
    assert float(t.range_peak) == 2.0**-19 and int(t.margin) == 1
    assert float(t.scale) == 2.0**18
    t = q.adjust(t, False, amax=a)  # peak 2**-19 decayed a little: 1 / peak just above 2**19
    assert float(t.scale) == 2.0**18
    # A blind overflow (nothing measured yet) backs off by blind_backoff, margin unchanged.
    b = p.adjust(p.init(), True, amax=jnp.float32(jnp.inf))
    assert float(b.scale) == 2.0**2 and int(b.margin) == 1


def test_state_dtypes_bounds_and_conform():
    p = lsj.HeadroomScale(init_scale=64.0, min_scale=4.0, max_scale=2.0**12, max_margin=3)
    s = jax.jit(p.adjust)(p.init(), jnp.bool_(False), amax=jnp.float32(0.0))
    for name, dtype in [("scale", jnp.float32), ("range_peak", jnp.float32), ("margin", jnp.int32)]:
        assert getattr(s, name).dtype == dtype and getattr(s, name).shape == (), name
    assert s.growth_count.dtype == jnp.int32 and s.last_skipped.dtype == jnp.bool_
    # tiny amax: the target is huge, capped at max_scale; huge amax: floored at min_scale
    assert float(p.adjust(p.init(), False, amax=jnp.float32(1e-30)).scale) == 2.0**12
    low = p.adjust(p.init(), False, amax=jnp.float32(1e30))
    assert float(low.scale) == 4.0
    stuck = p.adjust(low, True, amax=jnp.float32(jnp.inf))
    assert bool(stuck.stuck) and float(stuck.scale) == 4.0
    # a state made elsewhere (dynamic, scale out of range, margin out of range, nan peak)
    bad = (
        lsj.DynamicScale()
        .init()
        .replace(scale=jnp.float32(2.0**20), margin=jnp.int32(9), range_peak=jnp.float32(jnp.nan))
    )
    c = p.conform(bad)
    assert float(c.scale) == 2.0**12 and int(c.margin) == 3 and float(c.range_peak) == 0.0
    assert float(p.adjust(bad, False, amax=jnp.float32(2.0**-8)).scale) == 2.0**5  # 8 - 3
    sw = lsj.switch_policy(lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale()).init({}), p)
    assert int(lsj.get_loss_scale_state(sw).margin) == 1


# --------------------------------------------------------------------------
# Inside the transformations.


def _params():
    return {"a": jnp.ones((6, 4), jnp.float32), "b": jnp.ones((4,), jnp.float32)}


def _grads(scale_a: float, scale_b: float = 1.0):
    g = _params()
    return {
        "a": (g["a"] * scale_a).astype(jnp.float16),
        "b": (g["b"] * scale_b).astype(jnp.float16),
    }


@pytest.mark.parametrize("mode", ["ieee", "saturating", "both"])
def test_loss_scaling_measures_the_range_and_skips_on_overflow(mode):
    policy = lsj.HeadroomScale(init_scale=2.0**4, max_scale=math.inf)
    tx = lsj.loss_scaling(optax.sgd(0.5), policy, overflow=mode)
    params = _params()
    traces = []

    @jax.jit
    def step(params, state, grads):
        traces.append(1)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    bad = jnp.inf if mode != "saturating" else 65504.0
    seq = [_grads(8.0, 2.0), _grads(bad), _grads(16.0), _grads(1.0, 0.5)]
    # The steps run with no transfer to the host allowed and read nothing there (on a GPU
    # the guard fails a step that syncs); the checks read the results afterwards.
    runs = [(params, state)]
    with jax.transfer_guard("disallow"):
        for g in seq:
            runs.append(step(*runs[-1], g))
    ref = model_init(policy)
    for g, (old, _), (params, state) in zip(seq, runs[:-1], runs[1:], strict=True):
        ls = lsj.get_loss_scale_state(state)
        over = not bool(jnp.all(jnp.isfinite(g["a"]))) or float(jnp.max(g["a"])) >= F16_MAX
        amax = max(float(jnp.max(jnp.abs(x))) for x in g.values()) / (ref.scale * F16_MAX)
        ref = model_step(policy, ref, over, amax)
        assert float(ls.scale) == ref.scale and int(ls.margin) == ref.margin
        assert bool(ls.last_skipped) == over
        if over:
            for k in params:
                np.testing.assert_array_equal(params[k], old[k])
    assert len(traces) == 1
    assert_no_host_round_trip(step, *runs[0], seq[1])


@pytest.mark.slow
def test_fused_step_and_optax_path_agree():
    # Bit for bit where the two programs round the update alike (XLA:CPU with the conditional);
    # else each step from the same state within one ulp (helpers.programs_round_alike).
    alike = programs_round_alike()
    policy = lsj.HeadroomScale(init_scale=2.0**6)
    tx = lsj.loss_scaling(optax.adam(1e-2), policy)
    p1 = p2 = _params()
    s1 = s2 = tx.init(p1)
    for g in [_grads(3.0), _grads(jnp.inf), _grads(0.25, 40.0)]:
        before = (p1, s1)
        u, s1 = jax.jit(tx.update)(g, s1, p1)
        p1 = optax.apply_updates(p1, u)
        p2, s2 = jax.jit(lambda g, s, p: lsj.apply_gradients(tx, g, s, p))(
            g, *((s2, p2) if alike else (before[1], before[0]))
        )
        if alike:
            assert_bits_equal((p2, s2), (p1, s1))
        else:
            assert_step_within_ulps((p2, s2), (p1, s1), before, 1)
            p2, s2 = p1, s1
        assert_bits_equal(lsj.get_loss_scale_state(s2), lsj.get_loss_scale_state(s1))


def test_accumulation_takes_the_window_maximum():
    policy = lsj.HeadroomScale(init_scale=2.0**5, max_scale=math.inf)
    tx = lsj.loss_scaling_multi_steps(optax.sgd(0.1), policy, every_k=3)
    params = _params()
    state = tx.init(params)
    update = jax.jit(tx.update)
    # window 1: micro-batch maxima 2, 96, 5 -> the window's range is 96 / (32 * 65504)
    for g in [_grads(2.0), _grads(96.0), _grads(5.0)]:
        _, state = update(g, state, params)
    ref = model_step(policy, model_init(policy), False, 96.0 / (32.0 * F16_MAX))
    assert float(state.loss_scale.scale) == ref.scale
    assert float(state.window_range) == 0.0 and int(state.loss_scale.total_steps) == 1
    # window 2: an overflow in the middle micro-batch skips the window and widens the margin
    for g in [_grads(1.0), _grads(jnp.inf), _grads(1.0)]:
        _, state = update(g, state, params)
    ref = model_step(policy, ref, True, np.inf)
    assert float(state.loss_scale.scale) == ref.scale and bool(state.loss_scale.last_skipped)
    assert int(state.loss_scale.margin) == ref.margin == 2


def test_check_overflow_and_range_is_the_check_plus_the_maximum():
    g = {
        "h": jnp.array([1.0, -300.0, 2.0**-24], jnp.float16),
        "f": jnp.array([[2.0, -7.5]], jnp.float32),
        "b": jnp.array([4.0, 1.0, 3.0], jnp.bfloat16),
        "i": jnp.arange(3),
    }
    for mode in ["ieee", "saturating", "both"]:
        over, amax = lsj.check_overflow_and_range(g, mode)
        assert not bool(over) and float(amax) == 300.0  # the int leaf is not a gradient
        sat = {**g, "h": g["h"].at[0].set(-65504.0)}
        over, amax = lsj.check_overflow_and_range(sat, mode)
        assert bool(over) == bool(lsj.check_overflow(sat, mode)) == (mode != "ieee")
        assert float(amax) == 65504.0
    assert float(lsj.check_overflow_and_range({})[1]) == 0.0


def test_a_nan_in_saturating_mode_is_no_overflow_and_no_measurement():
    """A saturating device never writes nan, and the saturating check does not look for it;
    whatever the maximum makes of it, the step is applied and the range keeps its peak."""
    policy = lsj.HeadroomScale(init_scale=2.0**4)
    tx = lsj.loss_scaling(optax.sgd(0.1), policy, overflow="saturating")
    params = _params()
    state = jax.jit(tx.update)(_grads(2.0), tx.init(params), params)[1]
    peak = float(state.loss_scale.range_peak)
    g = _grads(1.0)
    g["b"] = g["b"].at[0].set(jnp.nan)
    new = jax.jit(tx.update)(g, state, params)[1].loss_scale
    assert not bool(new.last_skipped)
    # amax is 1/(scale*65504) or, if the nan reached the maximum, no measurement: either
    # way the peak is the old one decayed or this step's, never nan.
    assert np.isfinite(float(new.range_peak)) and float(new.range_peak) >= peak * 0.99


@pytest.mark.slow
def test_range_adds_no_pass_over_the_gradients():
    """With the range measured, the step reads each gradient leaf as often as with
    DynamicScale and runs as many kernels on the gradients: the range is the check's own
    reduction (one output per leaf, its coded max, from which the flag follows), so a group
    of 16 leaves of one shape is one kernel for both (two, when the range took an output of
    its own beside each flag: XLA:GPU split those kernels further, 22 against 12 on the
    185M LM's post step)."""
    hlo = import_benchmark("hlo")  # the benchmark's HLO reader (benchmarks/bench/hlo.py)

    rng = np.random.default_rng(0)
    shapes = [("a", (64, 48)), ("b", (48,)), *((f"l{i:02d}", (48, 48)) for i in range(16))]
    params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes}
    grads = jax.tree_util.tree_map(lambda p: p.astype(jnp.float16), params)

    def compiled(policy):
        tx = lsj.loss_scaling(optax.adam(1e-3), policy, attribution=None)

        def step(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        return jax.jit(step).lower(params, tx.init(params), grads).compile().as_text()

    dyn, head = compiled(lsj.DynamicScale()), compiled(lsj.HeadroomScale())

    def kernels_on_grads(text):
        """The kernels that read a gradient and reduce it: the check's. Under a select (a GPU's
        formulation) the optimizer's kernels read the gradients in the same computation; they
        reduce nothing, and are not counted."""
        comps, entry = hlo.parse_hlo(text)
        names = {
            i["name"]
            for i in comps[entry]
            if i["op"] == "parameter" and 'op_name="grads' in i["line"]
        }

        def reduces(fusion):
            called = re.search(r"calls=%?([\w.\-]+)", fusion["line"]).group(1)
            return any(j["op"] == "reduce" for j in comps[called])

        return sum(
            1
            for i in comps[entry]
            if i["op"] == "fusion" and set(i["operands"]) & names and reduces(i)
        )

    for k in params:
        assert hlo.reads(head, f"grads['{k}']") == hlo.reads(dyn, f"grads['{k}']"), k
    # as many conditionals as DynamicScale's step: one under the CPU's formulation, none under
    # a GPU's select (the skip's formulation, not the range, decides)
    assert hlo.count(head, "conditional") == hlo.count(dyn, "conditional")
    assert kernels_on_grads(head) == kernels_on_grads(dyn) == 3  # a, b, and the 16 together


@pytest.mark.multidevice
@pytest.mark.slow
@pytest.mark.parametrize("attribution", ["reduced", "local"])
def test_pmap_reduces_flag_range_and_record_in_one_collective(attribution):
    n = 8
    policy = lsj.HeadroomScale(init_scale=2.0**3, max_scale=math.inf)
    tx = lsj.loss_scaling(optax.sgd(0.1), policy, axis_name="d", attribution=attribution)
    params = _params()

    state, pparams = replicate(tx.init(params), n), replicate(params, n)
    mult = jnp.arange(1, n + 1, dtype=jnp.float32)  # device i: max |g| = i + 1

    def per_device(m, params):
        return jax.tree_util.tree_map(lambda p: (p * m).astype(jnp.float16), params)

    grads = jax.vmap(per_device)(mult, pparams)

    step = jax.pmap(lambda g, s, p: tx.update(g, s, p)[1], axis_name="d")
    new = step(grads, state, pparams)
    scales = np.asarray(new.loss_scale.scale)
    ref = model_step(policy, model_init(policy), False, 8.0 / (8.0 * F16_MAX))
    assert np.all(scales == ref.scale)
    text = step.lower(grads, state, pparams).compile().as_text()
    assert text.count("all-reduce(") + text.count("all-reduce-start(") == 1
    # an overflow on one device skips on all of them
    grads = jax.tree_util.tree_map(lambda g: g.at[3, 0].set(jnp.inf), grads)
    new = step(grads, state, pparams)
    assert np.all(np.asarray(new.loss_scale.last_skipped))
    # blind (nothing measured yet): 8 * 2**-8, floored at min_scale = 1
    assert np.all(np.asarray(new.loss_scale.scale) == 1.0)


@pytest.mark.multidevice
@pytest.mark.slow
def test_shard_map_same_decision_everywhere():
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    policy = lsj.HeadroomScale(init_scale=2.0**3)
    tx = lsj.loss_scaling(optax.sgd(0.1), policy, axis_name="d")
    params = {"w": jnp.ones((4, 3), jnp.float32)}
    state = tx.init(params)
    grads = {"w": (jnp.arange(12, dtype=jnp.float32).reshape(4, 3) + 1).astype(jnp.float16)}

    def step(g, s, p):
        return tx.update(g, s, p)[1].loss_scale

    out = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("d"), P(), P()), out_specs=P()))(
        grads, state, params
    )
    ref = model_step(policy, model_init(policy), False, 12.0 / (8.0 * F16_MAX))
    assert float(out.scale) == ref.scale


def test_checkpoint_round_trip():
    policy = lsj.HeadroomScale(init_scale=2.0**6)
    tx = lsj.loss_scaling(optax.adam(1e-3), policy)
    params = _params()
    state = tx.init(params)
    _, state = jax.jit(tx.update)(_grads(5.0), state, params)
    saved = serialization.to_state_dict(state)
    back = lsj.restore_flax(tx.init(params), saved, policy=policy)
    a, b = lsj.get_loss_scale_state(state), lsj.get_loss_scale_state(back)
    for k in ("scale", "range_peak", "margin", "growth_count"):
        assert getattr(a, k) == getattr(b, k) and getattr(a, k).dtype == getattr(b, k).dtype


def _float16_loss_run(use_taps: bool, steps: int = 40) -> tuple[list[float], list[bool]]:
    """HeadroomScale on a float16 loss whose parameter gradients show room far above 2**16."""
    params = {"w": jnp.full((4,), 0.01)}
    x = jnp.full((4,), 1e-3, jnp.float16)
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.HeadroomScale(init_scale=2.0**4))

    @jax.jit
    def step(params, state):
        p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), params)

        def scaled(p):
            return lsj.scale_loss(jnp.sum(p["w"] * x), state)  # a float16 loss

        if use_taps:
            _, grads, taps = lsj.taps.value_and_grad(scaled)(p16)
            updates, state = tx.update(grads, state, params, taps=taps)
        else:
            updates, state = tx.update(jax.grad(scaled)(p16), state, params)
        return optax.apply_updates(params, updates), state

    state, scales, skipped = tx.init(params), [], []
    for _ in range(steps):
        params, state = step(params, state)
        scales.append(float(state.loss_scale.scale))
        skipped.append(bool(state.loss_scale.last_skipped))
    return scales, skipped


@pytest.mark.slow
def test_a_float16_loss_without_taps_gets_the_loss_taps_room(monkeypatch):
    # The loss's cotangent is the scale itself: 2**16 overflows a float16 loss. scale_loss
    # notes the loss's dtype for the update of the same step, so HeadroomScale without taps
    # follows the run with the loss's tap, step for step.
    with_taps = _float16_loss_run(True)
    assert _float16_loss_run(False) == with_taps
    assert max(with_taps[0]) < 2.0**16 and not any(with_taps[1])
    # Without the note (what a step without taps saw before): the scale climbs into the
    # ceiling, overflows and skips. That is what the note prevents.
    from lossscale_jax.engine import _loss_note

    monkeypatch.setattr(_loss_note, "note", lambda scale, dtype: None)
    scales, skipped = _float16_loss_run(False)
    assert max(scales) > 2.0**16 and any(skipped)
