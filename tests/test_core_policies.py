"""Policies against a plain-Python reference model of the documented rule."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_policy  # tests/ is on sys.path under pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_scalers import ReferenceDynamic

import lossscale_jax as lsj

F32 = np.float32
I32_MAX = np.iinfo(np.int32).max


# Sequences with bursts of overflows and long good runs.
bursty = st.lists(
    st.tuples(st.booleans(), st.integers(min_value=1, max_value=40)), min_size=1, max_size=60
).map(lambda runs: [flag for flag, n in runs for _ in range(n)])


@pytest.mark.slow
@settings(max_examples=25)
@given(
    overflows=bursty,
    init_exp=st.integers(-3, 30),
    growth_factor=st.sampled_from([2.0, 1.5, 4.0]),
    backoff_factor=st.sampled_from([0.5, 0.8, 0.25]),
    growth_interval=st.integers(1, 12),
    hysteresis=st.integers(1, 4),
    consecutive=st.booleans(),
    bounds=st.sampled_from([(1.0, 2.0**24), (2.0**-14, 2.0**10), (0.5, float("inf"))]),
)
def test_dynamic_matches_reference(
    overflows,
    init_exp,
    growth_factor,
    backoff_factor,
    growth_interval,
    hysteresis,
    consecutive,
    bounds,
):
    lo, hi = bounds
    init = min(max(2.0**init_exp, lo), hi)
    policy = lsj.DynamicScale(
        init_scale=init,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        min_scale=lo,
        max_scale=hi,
    )
    states = run_policy(policy, overflows)
    ref = ReferenceDynamic(policy)
    expected = [ref.step(f) for f in overflows]
    np.testing.assert_array_equal(np.asarray(states.scale), [e[0] for e in expected])
    np.testing.assert_array_equal(np.asarray(states.last_skipped), overflows)
    np.testing.assert_array_equal(np.asarray(states.stuck), [e[2] for e in expected])
    assert np.all(np.asarray(states.scale) >= F32(lo))
    assert np.all(np.asarray(states.scale) <= F32(hi))
    n = len(overflows)
    np.testing.assert_array_equal(np.asarray(states.total_steps), np.arange(1, n + 1))
    np.testing.assert_array_equal(np.asarray(states.skipped_steps), np.cumsum(overflows))
    np.testing.assert_array_equal(np.asarray(states.overflow_steps), np.cumsum(overflows))


def test_hand_worked_trajectory():
    # init 8, grow x2 every 2 good steps, halve after 2 overflows in a row.
    policy = lsj.DynamicScale(init_scale=8.0, growth_interval=2, hysteresis=2, min_scale=2.0)
    seq = [False, False, True, False, True, True, True, True, True, True]
    #      g=1    grow16  h=1   h reset h=1  back8 h=1  back4 h=1  back2(floor)
    expected = [8, 16, 16, 16, 16, 8, 8, 4, 4, 2]
    states = run_policy(policy, seq)
    np.testing.assert_array_equal(np.asarray(states.scale), expected)


def test_accumulated_hysteresis_survives_good_steps():
    seq = [True, False, True]
    consecutive = lsj.DynamicScale(init_scale=64.0, hysteresis=2)
    accumulated = dataclasses.replace(consecutive, consecutive_hysteresis=False)
    assert float(run_policy(consecutive, seq).scale[-1]) == 64.0
    assert float(run_policy(accumulated, seq).scale[-1]) == 32.0


def test_growth_refused_when_not_finite():
    big = float(np.finfo(np.float32).max) / 1.5
    policy = lsj.DynamicScale(init_scale=big, growth_interval=1, max_scale=float("inf"))
    states = run_policy(policy, [False, False])
    assert np.all(np.isfinite(np.asarray(states.scale)))
    assert float(states.scale[-1]) == np.float32(big)
    np.testing.assert_array_equal(np.asarray(states.growth_count), [0, 0])


def test_growth_capped_at_max_and_floored_at_min():
    policy = lsj.DynamicScale(init_scale=3.0, growth_interval=1, min_scale=1.0, max_scale=5.0)
    assert float(run_policy(policy, [False]).scale[-1]) == 5.0
    assert float(run_policy(policy, [True, True, True]).scale[-1]) == 1.0


def test_stuck_only_at_floor():
    policy = lsj.DynamicScale(init_scale=2.0, min_scale=1.0)
    states = run_policy(policy, [True, True, False, True])
    np.testing.assert_array_equal(np.asarray(states.stuck), [False, True, False, True])


@pytest.mark.parametrize("policy", [lsj.StaticScale(128.0), lsj.NoScale(skip_on_overflow=True)])
def test_fixed_policies_never_move(policy):
    seq = [False, True, True, False]
    states = run_policy(policy, seq)
    want = 128.0 if isinstance(policy, lsj.StaticScale) else 1.0
    np.testing.assert_array_equal(np.asarray(states.scale), [want] * 4)
    np.testing.assert_array_equal(np.asarray(states.last_skipped), seq)
    np.testing.assert_array_equal(np.asarray(states.skipped_steps), [0, 1, 2, 2])


def test_noscale_counts_but_does_not_skip_by_default():
    states = run_policy(lsj.NoScale(), [True, False])
    np.testing.assert_array_equal(np.asarray(states.last_skipped), [False, False])
    np.testing.assert_array_equal(np.asarray(states.overflow_steps), [1, 1])
    np.testing.assert_array_equal(np.asarray(states.skipped_steps), [0, 0])


def test_static_skip_can_be_turned_off():
    states = run_policy(lsj.StaticScale(4.0, skip_on_overflow=False), [True])
    assert not bool(states.last_skipped[0]) and int(states.overflow_steps[0]) == 1


def test_counters_saturate_instead_of_wrapping():
    policy = lsj.StaticScale(2.0)
    s = policy.init().replace(
        total_steps=jnp.asarray(I32_MAX, jnp.int32), skipped_steps=jnp.asarray(I32_MAX, jnp.int32)
    )
    s = jax.jit(policy.adjust)(s, True)
    assert int(s.total_steps) == I32_MAX and int(s.skipped_steps) == I32_MAX


def test_state_dtypes_and_fields():
    s = lsj.DynamicScale().init()
    expected = {
        "scale": jnp.float32,
        "growth_count": jnp.int32,
        "hysteresis_count": jnp.int32,
        "last_overflow": jnp.bool_,
        "last_skipped": jnp.bool_,
        "stuck": jnp.bool_,
        "total_steps": jnp.int32,
        "overflow_steps": jnp.int32,
        "skipped_steps": jnp.int32,
        "recent_overflow_rate": jnp.float32,
        "range_peak": jnp.float32,
        "margin": jnp.int32,
    }
    fields = {f.name for f in dataclasses.fields(s)}
    assert fields == set(expected) | {"policy_state"}
    assert s.policy_state is None  # no state of its own (see test_policy_state_*)
    for name, dtype in expected.items():
        value = getattr(s, name)
        assert value.dtype == dtype and value.shape == (), name
    after = jax.jit(lsj.DynamicScale().adjust)(s, jnp.array(True))
    for name, dtype in expected.items():
        assert getattr(after, name).dtype == dtype, name


def _distinct_state():
    # Every field differs from its initial value, so a dropped field shows.
    return (
        lsj.DynamicScale()
        .init()
        .replace(
            scale=jnp.asarray(3.0, jnp.float32),
            growth_count=jnp.asarray(5, jnp.int32),
            hysteresis_count=jnp.asarray(2, jnp.int32),
            last_overflow=jnp.asarray(True),
            last_skipped=jnp.asarray(True),
            stuck=jnp.asarray(True),
            total_steps=jnp.asarray(11, jnp.int32),
            overflow_steps=jnp.asarray(7, jnp.int32),
            skipped_steps=jnp.asarray(6, jnp.int32),
            recent_overflow_rate=jnp.asarray(0.25, jnp.float32),
            range_peak=jnp.asarray(0.5, jnp.float32),
            margin=jnp.asarray(3, jnp.int32),
            policy_state={"count": jnp.asarray(4, jnp.int32), "peak": jnp.ones(2, jnp.float16)},
        )
    )


def _assert_same_state(a, b):
    names = [f.name for f in dataclasses.fields(a)]
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for (path, x), y in zip(
        jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b), strict=True
    ):
        assert x.dtype == y.dtype, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))
    assert len(jax.tree_util.tree_leaves(a)) == len(names) - 1 + 2  # policy_state: 2 leaves


def test_state_round_trips_jit_tree_map_pmap():
    s = _distinct_state()
    _assert_same_state(jax.jit(lambda x: x)(s), s)
    _assert_same_state(jax.tree_util.tree_map(lambda x: x, s), s)
    leaves, treedef = jax.tree_util.tree_flatten(s)
    _assert_same_state(jax.tree_util.tree_unflatten(treedef, leaves), s)
    n = jax.local_device_count()
    replicated = jax.tree_util.tree_map(lambda x: jnp.stack([x] * n), s)
    out = jax.pmap(lambda x: x)(replicated)
    for i in range(n):
        _assert_same_state(jax.tree_util.tree_map(lambda x, i=i: x[i], out), s)


def test_policies_are_hashable_static_values():
    assert hash(lsj.DynamicScale()) == hash(lsj.DynamicScale())
    assert lsj.StaticScale(2.0) == lsj.StaticScale(2.0)


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        ({"init_scale": 0.0}, ValueError, "init_scale"),
        ({"init_scale": -1.0}, ValueError, "init_scale"),
        ({"init_scale": math.inf}, ValueError, "init_scale"),
        ({"init_scale": math.nan}, ValueError, "init_scale"),
        ({"init_scale": 1e39, "max_scale": math.inf}, ValueError, "float32"),
        ({"init_scale": "big"}, TypeError, "init_scale"),
        ({"growth_factor": 1.0}, ValueError, "growth_factor"),
        ({"growth_factor": 0.5}, ValueError, "growth_factor"),
        ({"growth_factor": math.inf}, ValueError, "growth_factor"),
        ({"backoff_factor": 1.0}, ValueError, "backoff_factor"),
        ({"backoff_factor": 2.0}, ValueError, "backoff_factor"),
        ({"backoff_factor": 0.0}, ValueError, "backoff_factor"),
        ({"growth_interval": 0}, ValueError, "growth_interval"),
        ({"growth_interval": 2.5}, TypeError, "growth_interval"),
        ({"growth_interval": True}, TypeError, "growth_interval"),
        ({"growth_interval": 2**31}, ValueError, "growth_interval"),
        ({"hysteresis": 0}, ValueError, "hysteresis"),
        ({"consecutive_hysteresis": 1}, TypeError, "consecutive_hysteresis"),
        ({"min_scale": 0.0}, ValueError, "min_scale"),
        ({"min_scale": 4.0, "max_scale": 2.0, "init_scale": 3.0}, ValueError, "min_scale"),
        ({"max_scale": -1.0}, ValueError, "max_scale"),
        ({"max_scale": math.nan}, ValueError, "max_scale"),
        ({"init_scale": 2.0**30}, ValueError, "init_scale"),
        ({"init_scale": 0.5}, ValueError, "init_scale"),
    ],
)
def test_dynamic_rejects_bad_hyperparameters(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        lsj.DynamicScale(**kwargs)


@pytest.mark.parametrize(
    "make, exc, words",
    [
        (lambda: lsj.StaticScale(0.0), ValueError, "scale"),
        (lambda: lsj.StaticScale(-2.0), ValueError, "scale"),
        (lambda: lsj.StaticScale(math.inf), ValueError, "scale"),
        (lambda: lsj.StaticScale(None), TypeError, "scale"),
        (lambda: lsj.StaticScale(1e-50), ValueError, "underflows"),
        (lambda: lsj.StaticScale(2.0, skip_on_overflow="yes"), TypeError, "skip_on_overflow"),
        (lambda: lsj.NoScale(skip_on_overflow=0), TypeError, "skip_on_overflow"),
    ],
)
def test_fixed_policies_reject_bad_arguments(make, exc, words):
    with pytest.raises(exc, match=words):
        make()


def test_adjust_rejects_non_scalar_flag():
    with pytest.raises(ValueError, match="scalar"):
        lsj.DynamicScale().adjust(lsj.DynamicScale().init(), jnp.zeros(3, jnp.bool_))


# --------------------------------------------------------------------------
# A state the policy did not make (resumed, reused, switched): the policy still rules.


def foreign(scale, **fields):
    """A state as another policy (or a checkpoint) left it."""
    return (
        lsj.DynamicScale(init_scale=2.0**15)
        .init()
        .replace(
            scale=jnp.asarray(scale, jnp.float32),
            growth_count=jnp.asarray(fields.get("growth_count", 7), jnp.int32),
            hysteresis_count=jnp.asarray(fields.get("hysteresis_count", 1), jnp.int32),
            total_steps=jnp.asarray(100, jnp.int32),
            skipped_steps=jnp.asarray(3, jnp.int32),
        )
    )


@pytest.mark.parametrize("overflow", [False, True])
def test_static_and_noscale_write_their_own_scale(overflow):
    s = jax.jit(lsj.StaticScale(8.0).adjust)(foreign(2.0**15), overflow)
    assert float(s.scale) == 8.0 and int(s.total_steps) == 101
    s = jax.jit(lsj.NoScale().adjust)(foreign(2.0**15), overflow)
    assert float(s.scale) == 1.0 and int(s.skipped_steps) == 3  # NoScale does not skip


@pytest.mark.parametrize(
    "scale, overflow, want",
    [
        (2.0**15, False, 16.0),  # above max_scale: clipped down
        (2.0**15, True, 16.0),  # backed off to 2**14, still above: clipped
        (0.25, False, 2.0),  # below min_scale: clipped up
        (0.25, True, 2.0),
        (0.0, False, 2.0),  # a corrupted state: back into the range
        (-4.0, True, 2.0),
        (math.nan, False, 2.0),
        (math.inf, False, 16.0),
        (8.0, False, 8.0),  # in range: the ordinary rule (no growth yet, interval 1000)
        (8.0, True, 4.0),
    ],
)
def test_dynamic_keeps_any_state_in_its_range(scale, overflow, want):
    policy = lsj.DynamicScale(init_scale=8.0, min_scale=2.0, max_scale=16.0, growth_interval=1000)
    s = jax.jit(policy.adjust)(foreign(scale), overflow)
    assert float(s.scale) == want


def test_dynamic_clip_is_the_identity_in_range():
    """In-range states step exactly as the reference model says, also with max_scale=inf."""
    for policy in (
        lsj.DynamicScale(init_scale=2.0**126, max_scale=math.inf, growth_interval=1),
        lsj.DynamicScale(init_scale=1.0, min_scale=1.0, growth_interval=1),
    ):
        flags = [False, False, True, False, True, True, False]
        states = run_policy(policy, flags)
        ref = ReferenceDynamic(policy)
        want = []
        for f in flags:
            ref.step(f)
            want.append(F32(ref.scale))
        np.testing.assert_array_equal(np.asarray(states.scale), want)


def test_tolerant_keeps_any_state_in_its_range():
    policy = lsj.TolerantDynamicScale(init_scale=8.0, min_scale=2.0, max_scale=16.0)
    assert float(jax.jit(policy.adjust)(foreign(2.0**15), False).scale) == 16.0
    assert float(jax.jit(policy.adjust)(foreign(math.nan), False).scale) == 2.0


def test_conform_moves_the_scale_and_keeps_the_telemetry():
    s = foreign(2.0**15)
    for policy, want in [
        (lsj.StaticScale(8.0), 8.0),
        (lsj.NoScale(), 1.0),
        (lsj.DynamicScale(init_scale=4.0, max_scale=16.0), 16.0),
        (lsj.TolerantDynamicScale(init_scale=4.0, max_scale=16.0), 16.0),
    ]:
        c = jax.jit(policy.conform)(s)
        assert float(c.scale) == want
        # The scale moved: the counters since its last change restart; telemetry is kept.
        assert int(c.growth_count) == 0 and int(c.hysteresis_count) == 0
        assert int(c.total_steps) == 100 and int(c.skipped_steps) == 3
    # A scale the policy can hold stays, and so do the counters.
    kept = lsj.DynamicScale(init_scale=4.0).conform(s)
    assert float(kept.scale) == 2.0**15 and int(kept.growth_count) == 7
    # A state the policy made itself comes back unchanged (bit for bit).
    for policy in (lsj.StaticScale(3.0), lsj.DynamicScale(), lsj.TolerantDynamicScale(0.5)):
        fresh = policy.init()
        assert jax.tree_util.tree_all(
            jax.tree_util.tree_map(lambda a, b: bool(a == b), policy.conform(fresh), fresh)
        )


def test_a_policy_subclass_without_conform_says_so():
    class Mine(lsj.LossScalePolicy):
        def init(self):
            return lsj.StaticScale(2.0).init()

        def adjust(self, state, overflow, amax=None):
            return lsj.StaticScale(2.0).adjust(state, overflow)

    with pytest.raises(NotImplementedError, match="does not implement conform"):
        Mine().conform(Mine().init())


def test_a_policy_subclass_without_adjust_is_refused_when_built():
    """``init`` and ``adjust`` are abstract: a policy without them cannot be built."""

    class Mine(lsj.LossScalePolicy):
        def init(self):
            return lsj.StaticScale(2.0).init()

    with pytest.raises(TypeError, match="abstract method.*adjust"):
        Mine()


@pytest.mark.parametrize(
    "value",
    [
        1024,
        1024.0,
        np.float64(1024),
        np.float32(1024),
        jnp.float32(1024),
        np.int64(1024),
        jnp.asarray(1024.0),
        np.asarray(1024.0),
    ],
)
def test_concrete_scalars_are_accepted_alike(value):
    """Python, NumPy and JAX 0-d numbers all give the same (hashable, static) policy."""
    p = lsj.DynamicScale(
        init_scale=value, max_scale=jnp.float32(2.0**20), growth_interval=np.int32(10)
    )
    assert p == lsj.DynamicScale(init_scale=1024.0, max_scale=2.0**20, growth_interval=10)
    assert hash(p) == hash(
        lsj.DynamicScale(init_scale=1024.0, max_scale=2.0**20, growth_interval=10)
    )
    assert type(p.init_scale) is float and type(p.growth_interval) is int
    assert lsj.StaticScale(value) == lsj.StaticScale(1024.0)


@pytest.mark.parametrize(
    "make, exc, words",
    [
        (lambda: lsj.StaticScale(jnp.bool_(True)), TypeError, "scale must be a real number"),
        (lambda: lsj.StaticScale(np.bool_(True)), TypeError, "scale must be a real number"),
        (lambda: lsj.StaticScale(jnp.ones(2)), TypeError, "scale must be a real number"),
        (lambda: lsj.DynamicScale(growth_interval=jnp.float32(10)), TypeError, "must be an int"),
        (lambda: lsj.DynamicScale(hysteresis=jnp.bool_(True)), TypeError, "must be an int"),
    ],
)
def test_bools_arrays_and_wrong_kinds_are_rejected(make, exc, words):
    with pytest.raises(exc, match=words):
        make()


def test_traced_hyperparameters_are_rejected():
    with pytest.raises(TypeError, match="init_scale must be a concrete number, got a traced value"):
        jax.jit(lambda s: lsj.DynamicScale(init_scale=s).init().scale)(jnp.float32(8.0))


def test_keep_policy_state_keeps_its_own_and_starts_anything_else_fresh():
    fresh = {"n": jnp.zeros([], jnp.int32)}
    base = lsj.DynamicScale().init()
    mine = base.replace(policy_state={"n": jnp.asarray(5, jnp.int32)})
    assert lsj.keep_policy_state(mine, fresh) is mine
    others = [
        base,  # None: another policy's state
        base.replace(policy_state={"m": jnp.asarray(5, jnp.int32)}),  # other names
        base.replace(policy_state={"n": jnp.asarray(5, jnp.float32)}),  # other dtype
        base.replace(policy_state={"n": jnp.ones(3, jnp.int32)}),  # other shape
    ]
    for state in others:
        out = lsj.keep_policy_state(state, fresh)
        assert int(out.policy_state["n"]) == 0 and out.policy_state["n"].dtype == jnp.int32
        _assert_fields_kept(out, state)
    # A state with a leading axis (one value per device, from jax.pmap): fresh per device.
    stacked = jax.tree_util.tree_map(lambda x: jnp.stack([x] * 4), base)
    out = lsj.keep_policy_state(stacked, fresh)
    assert out.policy_state["n"].shape == (4,)
    assert lsj.keep_policy_state(out, fresh) is out
    # And a policy that keeps none drops another's.
    assert lsj.keep_policy_state(mine, None).policy_state is None


def _assert_fields_kept(a, b):
    for f in dataclasses.fields(a):
        if f.name != "policy_state":
            np.testing.assert_array_equal(getattr(a, f.name), getattr(b, f.name), f.name)
