"""Overflow attribution (the per-leaf record) and the recent overflow rate.

The record is checked against the faults the tests inject (which leaves got inf, nan or
+-65504), under jit, in the fused step, under pmap with the fault on one device (reduced and
local), and over the micro-batches of an accumulation window (Python sets as the reference).
The compiled step is read from its HLO: the record adds no read of the gradients, no
reduction, and a few bytes per leaf of temporaries. The recent rate is compared with a NumPy
reference of its rule on random overflow sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (  # tests/ is on sys.path under pytest
    FLOAT16_PARAMS,
    import_benchmark,
    replicate,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import lossscale_jax as lsj
from lossscale_jax.policies import RECENT_STEPS

hlo = import_benchmark("hlo")  # the benchmark's HLO reader (benchmarks/bench/hlo.py)

BAD = (np.inf, -np.inf, np.nan, 65504.0, -65504.0)


def _trees() -> dict:
    f16, f32 = jnp.float16, jnp.float32
    return {
        "flat": {"a": jnp.ones((3, 4), f16), "b": jnp.ones((5,), f32), "c": jnp.ones((), f16)},
        "nested": {
            "enc": {
                "Dense_0": {"kernel": jnp.ones((4, 4), f32), "bias": jnp.ones((4,), f32)},
                "Dense_1": {"kernel": jnp.ones((4, 4), f32), "bias": jnp.ones((4,), f32)},
            },
            "dec": [jnp.ones((4, 4), f16), jnp.ones((4,), f16)],
        },
        # 18 leaves of one shape: two groups of the grouped check (16 + 2).
        "grouped": {f"l{i:02d}": jnp.ones((2, 3), f32) for i in range(18)},
    }


TREES = _trees()
TX = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=2.0**8), overflow="both")
_STEPS: dict = {}
TRACES: dict = {}


def _step(tree: str, fused: bool):
    """One jitted step per tree and path, the faults given as data (compiled once)."""
    key = (tree, fused)
    if key not in _STEPS:

        def step(params, state, grads, masks, bads):
            TRACES[key] = TRACES.get(key, 0) + 1
            grads = jax.tree_util.tree_map(
                lambda g, m, b: jnp.where(m, b.astype(g.dtype), g), grads, masks, bads
            )
            if fused:
                return lsj.apply_gradients(TX, grads, state, params)[1]
            return TX.update(grads, state, params)[1]

        _STEPS[key] = jax.jit(step)
    return _STEPS[key]


@st.composite
def faults(draw):
    """A tree, and for each of its leaves: no fault, or one bad value at one position."""
    name = draw(st.sampled_from(sorted(TREES)))
    leaves = jax.tree_util.tree_leaves(TREES[name])
    hits = []
    for leaf in leaves:
        if draw(st.booleans()) and draw(st.booleans()):  # about a quarter of the leaves
            hits.append((draw(st.integers(0, leaf.size - 1)), draw(st.sampled_from(BAD))))
        else:
            hits.append(None)
    return name, hits


@FLOAT16_PARAMS
@pytest.mark.slow
@settings(max_examples=15)
@given(faults())
def test_record_names_exactly_the_leaves_hit(case):
    name, hits = case
    params = TREES[name]
    treedef = jax.tree_util.tree_structure(params)
    leaves = jax.tree_util.tree_leaves(params)
    masks, bads = [], []
    for leaf, hit in zip(leaves, hits, strict=True):
        mask = np.zeros(leaf.size, bool)
        if hit is not None:
            mask[hit[0]] = True
        masks.append(mask.reshape(leaf.shape))
        bads.append(np.float32(hit[1] if hit is not None else 0.0))
    rng = np.random.default_rng(len(leaves))
    grads = [np.asarray(rng.normal(size=leaf.shape) * 4.0, leaf.dtype) for leaf in leaves]
    args = jax.device_put(
        (
            params,
            TX.init(params),
            treedef.unflatten(grads),
            treedef.unflatten(masks),
            treedef.unflatten(bads),
        )
    )
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    expected = [p for p, hit in zip(paths, hits, strict=True) if hit is not None]
    for fused in (False, True):
        with jax.transfer_guard("disallow"):
            state = _step(name, fused)(*args)
        assert lsj.overflowed_leaves(state, params) == expected, (fused, hits)
        m = lsj.metrics(state)
        assert bool(m["overflow"]) == bool(expected) == bool(m["skipped"])
        assert int(m["overflow_leaves"]) == len(expected)
        first = paths.index(expected[0]) if expected else -1
        assert int(m["first_overflow_leaf"]) == first
        assert TRACES[(name, fused)] == 1  # one trace per tree, whatever the faults


@FLOAT16_PARAMS
def test_record_without_attribution_and_errors():
    params = TREES["flat"]
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.StaticScale(2.0), attribution=None)
    state = tx.init(params)
    assert state.leaf_overflow is None
    bad = jax.tree_util.tree_map(lambda p: jnp.full_like(p, jnp.inf), params)
    _, state = tx.update(bad, state, params)
    assert bool(lsj.metrics(state)["overflow"]) and "overflow_leaves" not in lsj.metrics(state)
    with pytest.raises(ValueError, match="keeps no per-leaf overflow record"):
        lsj.overflowed_leaves(state, params)
    # A corrupted scale is an overflow that no leaf caused.
    state = TX.init(params)
    state = state._replace(loss_scale=state.loss_scale.replace(scale=jnp.float32(0.0)))
    _, state = TX.update(jax.tree_util.tree_map(jnp.ones_like, params), state, params)
    assert bool(lsj.metrics(state)["overflow"]) and lsj.overflowed_leaves(state, params) == []


@FLOAT16_PARAMS
@pytest.mark.multidevice
@pytest.mark.slow
@pytest.mark.parametrize("attribution", ["reduced", "local"])
def test_pmap_fault_on_one_device(attribution):
    """The decision is reduced either way; the record is every device's OR ("reduced",
    the same state on every device) or each device's own ("local")."""
    n = 8
    params = {"b": jnp.ones((3,), jnp.float32), "v": jnp.ones((2,), jnp.float16)}
    params["w"] = jnp.ones((4, 3), jnp.float32)
    tx = lsj.loss_scaling(
        optax.sgd(0.1), lsj.DynamicScale(), axis_name="i", attribution=attribution
    )
    traces = []

    def step(params, state, grads, device, leaf):
        traces.append(1)
        here = jax.lax.axis_index("i") == device
        grads = {
            k: jnp.where(jnp.logical_and(here, leaf == i), jnp.inf, g).astype(g.dtype)
            for i, (k, g) in enumerate(sorted(grads.items()))
        }
        return tx.update(grads, state, params)[1]

    pstep = jax.pmap(step, axis_name="i")
    rep = jax.pmap(lambda x: x)
    args = rep(replicate((params, tx.init(params), params), n))
    names = ["['b']", "['v']", "['w']"]  # leaf order (sorted keys)
    for device, leaf in [(3, 1), (0, 2), (7, 0)]:
        d, k = rep(replicate((np.int32(device), np.int32(leaf)), n))
        with jax.transfer_guard("disallow"):
            state = pstep(*args, d, k)
        skipped = np.asarray(state.loss_scale.last_skipped)
        assert skipped.all()  # one decision on every device
        for i in range(n):
            mine = jax.tree_util.tree_map(lambda x, i=i: x[i], state)
            named = lsj.overflowed_leaves(mine, params)
            if attribution == "reduced" or i == device:
                assert named == [names[leaf]], (i, named)
            else:
                assert named == [], (i, named)
    assert len(traces) == 1
    with pytest.raises(ValueError, match="one per device"):
        lsj.overflowed_leaves(state, params)


@settings(max_examples=10)
@given(st.lists(st.lists(st.booleans(), min_size=3, max_size=3), min_size=7, max_size=7))
def test_accumulation_record_is_the_or_over_the_window(schedule):
    """Seven micro-batches, windows of three. The window in progress keeps the OR of its
    micro-batches so far (``window_leaf_overflow``); ``overflowed_leaves`` and ``metrics``
    report the last completed window, also between its micro-batches, so they agree with
    ``metrics()["overflow"]`` at every call."""
    every_k = 3
    step = _accumulation_step(every_k)
    params = {"a": jnp.ones((3,), jnp.float32), "b": jnp.ones((2, 2), jnp.float32)}
    params["c"] = jnp.ones((4,), jnp.float32)
    names = ["['a']", "['b']", "['c']"]
    state = _ACC_TX.init(params)
    window: set[str] = set()
    completed: set[str] = set()
    for t, hits in enumerate(schedule):
        if t % every_k == 0:
            window = set()
        window |= {name for name, h in zip(names, hits, strict=True) if h}
        hits = jax.device_put(np.asarray(hits))
        with jax.transfer_guard("disallow"):
            state = step(params, state, hits)
        if t % every_k == every_k - 1:  # the window ended: its skip decision matches
            completed = set(window)
            assert bool(state.loss_scale.last_overflow) == bool(window)
        record = np.asarray(state.window_leaf_overflow)
        running = {n for n, f in zip(names, record, strict=True) if f}
        assert running == (set() if t % every_k == every_k - 1 else window), (t, schedule)
        assert set(lsj.overflowed_leaves(state, params)) == completed, (t, schedule)
        m = lsj.metrics(state)
        assert bool(m["overflow"]) == bool(completed)
        assert int(m["overflow_leaves"]) == len(completed)
    assert _ACC_TRACES == [1]


_ACC_TX = lsj.loss_scaling_multi_steps(optax.sgd(0.1), lsj.StaticScale(4.0), every_k=3)
_ACC_TRACES: list = []
_ACC_STEP: list = []


def _accumulation_step(every_k):
    if not _ACC_STEP:

        def step(params, state, hits):
            _ACC_TRACES.append(1)
            grads = {
                k: jnp.where(hits[i], jnp.nan, jnp.ones_like(p))
                for i, (k, p) in enumerate(sorted(params.items()))
            }
            return _ACC_TX.update(grads, state, params)[1]

        _ACC_STEP.append(jax.jit(step))
    return _ACC_STEP[0]


@pytest.mark.slow
@pytest.mark.usefixtures("platform_formulation")  # the program the backend runs (conftest)
def test_record_adds_no_pass_over_the_gradients():
    """With and without the record, the compiled steps read each gradient leaf as often and
    make the same reductions; the record costs a few bytes per leaf of temporaries."""
    rng = np.random.default_rng(3)
    params = {"big": jnp.asarray(rng.normal(size=(128, 64)), jnp.float32)}
    params |= {f"l{i:02d}": jnp.asarray(rng.normal(size=(16, 24)), jnp.float32) for i in range(18)}
    params["v"] = jnp.ones((100,), jnp.float32)
    grads = jax.tree_util.tree_map(lambda p: p.astype(jnp.float16), params)
    n_leaves, n_params = len(params), sum(p.size for p in params.values())
    inner = optax.adam(1e-3)
    for fused in (True, False):
        texts, temps = {}, {}
        for attribution in ("reduced", None):
            tx = lsj.loss_scaling(inner, lsj.DynamicScale(), attribution=attribution)

            def step(params, state, grads, tx=tx, fused=fused):
                if fused:
                    return lsj.apply_gradients(tx, grads, state, params)
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            compiled = jax.jit(step, donate_argnums=(0, 1))
            compiled = compiled.lower(params, tx.init(params), grads).compile()
            texts[attribution] = compiled.as_text()
            temps[attribution] = compiled.memory_analysis().temp_size_in_bytes
        for k in grads:
            label = f"grads['{k}']"
            assert hlo.reads(texts["reduced"], label) == hlo.reads(texts[None], label), (fused, k)
        assert hlo.count(texts["reduced"], "reduce") == hlo.count(texts[None], "reduce"), fused
        # The record is n_leaves bools next to the scalar flag: a few bytes per leaf
        # (measured: 256 bytes for 20 leaves in the fused step), not one per parameter.
        extra = temps["reduced"] - temps[None]
        assert extra <= 16 * n_leaves < n_params // 20, (fused, temps)
        comps, _ = hlo.parse_hlo(texts["reduced"])
        assert any(i["shape"] == f"pred[{n_leaves}]" for c in comps.values() for i in c)


# --------------------------------------------------------------------------
# The recent overflow rate.


def _reference_rates(flags: np.ndarray) -> np.ndarray:
    """The rule in NumPy float32: the mean so far, then an EMA with weight 1/RECENT_STEPS."""
    out, rate, overflows = [], np.float32(0.0), 0
    for t, f in enumerate(flags, start=1):
        overflows += int(f)
        if t <= RECENT_STEPS:
            rate = np.float32(overflows) / np.float32(t)
        else:
            rate = np.float32(rate + (np.float32(f) - rate) / np.float32(RECENT_STEPS))
        out.append(rate)
    return np.asarray(out, np.float32)


POLICIES = (
    lsj.DynamicScale(init_scale=2.0**10, growth_interval=50),
    lsj.StaticScale(8.0),
    lsj.NoScale(),
    lsj.TolerantDynamicScale(overflow_tolerance=0.01),
    # A compat policy whose adjust is its own (it calls the base rule, then corrects).
    lsj.compat.deepspeed.fp16_optimizer_policy(dynamic_loss_scale=True, initial_dynamic_scale=1024),
)


@jax.jit
def _rates(flags):
    def run(policy):
        def body(state, flag):
            state = policy.adjust(state, flag)
            return state, state.recent_overflow_rate

        return jax.lax.scan(body, policy.init(), flags)[1]

    return [run(p) for p in POLICIES]


@settings(max_examples=4)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.003, 0.02, 0.3]))
def test_recent_rate_matches_a_numpy_reference(seed, p):
    rng = np.random.default_rng(seed)
    n = RECENT_STEPS + 600
    flags = rng.random(n) < p
    # A burst after the first window: what the rate is there to show.
    flags[RECENT_STEPS + 100 : RECENT_STEPS + 130] = True
    expected = _reference_rates(flags)
    for policy, got in zip(POLICIES, _rates(jnp.asarray(flags)), strict=True):
        got = np.asarray(got)
        assert got.dtype == np.float32
        # The first window exactly (one division); after it, to float32 rounding (XLA may
        # contract the update into a fused multiply-add).
        np.testing.assert_array_equal(got[:RECENT_STEPS], expected[:RECENT_STEPS], repr(policy))
        np.testing.assert_allclose(got, expected, rtol=4e-7, atol=1e-10, err_msg=repr(policy))
    # The first window is the mean so far; after it, a float64 EMA agrees to rounding.
    t = np.arange(1, n + 1)
    np.testing.assert_allclose(expected[:RECENT_STEPS], (np.cumsum(flags) / t)[:RECENT_STEPS])
    ema = np.cumsum(flags[:RECENT_STEPS])[-1] / RECENT_STEPS
    for f in flags[RECENT_STEPS:]:
        ema += (f - ema) / RECENT_STEPS
    np.testing.assert_allclose(expected[-1], ema, rtol=1e-4, atol=1e-7)
    # A burst of 30 overflows in a row raises the rate by about 30 * (1 - rate) / 2000:
    # 1.5% on a clean run, enough to cross a 0.5% alert within the burst.
    before = expected[RECENT_STEPS + 99]
    rise = expected[RECENT_STEPS + 129] - before
    assert 0.95 * 30 * (1 - before) / RECENT_STEPS < rise < 30 / RECENT_STEPS
