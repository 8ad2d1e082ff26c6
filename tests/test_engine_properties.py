"""Every front-end x every policy x every overflow mode against the engine's NumPy model.

Hypothesis draws sequences of good and bad micro-batches (inf, -inf, nan, +-65504, a
float32 gradient past 65504, ``-0.0`` gradients) for parameters that hold ``-0.0`` in
float32 and float16 leaves; each front-end steps them and, after every call, its
parameters, inner optimizer state, loss-scale state (every counter), per-leaf record,
train-state step and ``metrics`` must equal ``reference_engine.Reference`` bit for bit
(two nans count as equal; nothing else is loosened).

Front-ends: the Optax path (``loss_scaling`` + ``optax.apply_updates``), the fused
``apply_gradients``, ``loss_scaling_multi_steps`` (windows of 1 to 4), ``TrainState``
(fused, and over windows), ``LossScaleOptimizer`` (NNX) and
``compat.torch.multi_optimizer`` (two partitions, each skipped for its own overflow).

Scales are powers of two (every policy's own, and the static ones chosen so): unscaling
is then exact, so no backend's contraction of a multiply and an add into one fused
multiply-add (XLA:CPU contracts the engine's ``acc + g / scale``) can change a bit; the
inner transformation keeps the gradient it is handed without arithmetic on it, for the
same reason. The
unscale by other scales is checked against NumPy in test_core_numerics.py, and the fused
step against the Optax path in test_flax.py and test_performance.py.

Cost: one compilation per front-end and policy, which steps the three overflow modes at
once (the fault is data, not a Python value).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import skip_formulation  # tests/ is on sys.path under pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_engine import Reference

import lossscale_jax as lsj
from lossscale_jax import compat
from lossscale_jax.engine import _division, _skip

# The h leaf is a float16 parameter on purpose (the dtypes the front-ends must keep), under an
# inner that runs in its dtype: each front-end's init warns so, as it should.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::lossscale_jax.errors.Float16OptimizerWarning"),
]

MODES = ("ieee", "saturating", "both")
# Leaf order (tree_leaves, sorted keys): b (float32), h (float16), w (float32).
PARAMS = {
    "b": np.array([-0.0, 0.5], np.float32),
    "h": np.array([0.25, -0.0, -64000.0], np.float16),  # near the top: an update may not land
    "w": np.array([[0.25, -0.0, 0.0], [1.0, -0.5, 0.75]], np.float32),
}
# The gradients' dtypes: float16 for b and h (taken w.r.t. float16 copies), float32 for w
# (taken w.r.t. the float32 weights, cast inside the loss).
GRAD_DTYPES = {"b": np.float16, "h": np.float16, "w": np.float32}
NAMES = sorted(PARAMS)
SIZES = [PARAMS[k].size for k in NAMES]

POLICIES = {
    "no_scale": lsj.NoScale(),
    "no_scale_skip": lsj.NoScale(skip_on_overflow=True),
    "static_4": lsj.StaticScale(4.0),
    "static_8_no_skip": lsj.StaticScale(8.0, skip_on_overflow=False),
    "dynamic": lsj.DynamicScale(
        init_scale=2.0**4, growth_interval=2, hysteresis=2, min_scale=1.0, max_scale=2.0**6
    ),
    "tolerant": lsj.TolerantDynamicScale(
        init_scale=2.0**5,
        growth_interval=3,
        overflow_tolerance=0.34,
        min_scale=2.0,
        max_scale=2.0**8,
    ),
    "headroom": lsj.HeadroomScale(
        init_scale=2.0**10, window=4, margin_interval=3, max_margin=3, max_scale=2.0**20
    ),
}


class CountState(NamedTuple):
    count: jax.Array
    last: Any


def counting_sgd() -> optax.GradientTransformation:
    """The reference's inner rule: ``updates = g * -0.5``, ``count += 1``, ``last = g``.

    ``last`` keeps the gradient handed over as it is (no arithmetic on it: a sum would
    let XLA contract the producer of ``g``, the window's mean, with it into one fused
    multiply-add, and the optimization barrier that could stop it is removed on CPU).
    """

    def init(params):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        return CountState(jnp.zeros([], jnp.int32), zeros)

    def update(updates, state, params=None):
        out = jax.tree_util.tree_map(lambda g: g * jnp.asarray(-0.5, g.dtype), updates)
        return out, CountState(state.count + 1, updates)

    return optax.GradientTransformation(init, update)


def _params() -> dict[str, jax.Array]:
    return {k: jnp.asarray(v) for k, v in PARAMS.items()}


class View(NamedTuple):
    """What is compared after every call, as lists in leaf order."""

    params: list[np.ndarray]
    counts: list[int]  # per inner partition
    last: list[np.ndarray]  # per leaf: the last gradient the inner state kept
    loss_scale: lsj.LossScaleState
    record: np.ndarray
    metrics: dict[str, Any]
    applied: int | None  # a train state's step; None where there is none


def _leaves(tree: Any) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _view(params, opt_state, applied=None) -> View:
    owner = opt_state
    if isinstance(owner.inner_state, CountState):
        counts = [int(owner.inner_state.count)]
        last = _leaves(owner.inner_state.last)
    else:  # multi_optimizer: optax.multi_transform's state, one CountState per label
        parts = owner.inner_state.inner_states
        counts = [int(parts[k].inner_state.count) for k in ("x", "y")]
        by_leaf = {}
        for k in ("x", "y"):
            flat = jax.tree_util.tree_flatten_with_path(parts[k].inner_state.last)[0]
            by_leaf.update({jax.tree_util.keystr(p): np.asarray(x) for p, x in flat})
        last = [by_leaf[f"['{n}']"] for n in NAMES]
    metrics = {k: np.asarray(v) for k, v in lsj.metrics(opt_state).items()}
    record = np.asarray(owner.leaf_overflow)
    return View(_leaves(params), counts, last, owner.loss_scale, record, metrics, applied)


# ------------------------------------------------------------------ front-ends


class FrontEnd:
    """Builds, for one policy, a jitted step that advances the three modes at once."""

    every_k = 1
    groups: list[list[int]] | None = None

    def __init__(self, policy):
        self.policy = policy
        self.step = jax.jit(self._step_all)
        self._txs: dict[str, optax.GradientTransformation] = {}

    def tx(self, mode: str) -> optax.GradientTransformation:
        """One transformation per mode, built once: a train state carries it as static
        data, so a new one per run would retrace the step."""
        if mode not in self._txs:
            self._txs[mode] = self.build_tx(mode)
        return self._txs[mode]

    def build_tx(self, mode: str) -> optax.GradientTransformation:
        if self.every_k == 1:
            return lsj.loss_scaling(counting_sgd(), self.policy, overflow=mode)
        return lsj.loss_scaling_multi_steps(
            counting_sgd(), self.policy, every_k=self.every_k, overflow=mode
        )

    def init(self) -> dict:
        return {m: self.init_one(m) for m in MODES}

    def _step_all(self, carry, grads):
        return {m: self.step_one(m, carry[m], grads) for m in MODES}

    def init_one(self, mode):
        params = _params()
        return params, self.tx(mode).init(params)

    def step_one(self, mode, carry, grads):
        params, opt_state = carry
        updates, opt_state = self.tx(mode).update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def view(self, carry, mode: str) -> View:
        return _view(*carry)


class Fused(FrontEnd):
    def step_one(self, mode, carry, grads):
        params, opt_state = carry
        return lsj.apply_gradients(self.tx(mode), grads, opt_state, params)


class Accumulation(FrontEnd):
    def __init__(self, policy, every_k):
        self.every_k = every_k
        super().__init__(policy)


class Linen(FrontEnd):
    def __init__(self, policy, every_k):
        self.every_k = every_k
        super().__init__(policy)

    def init_one(self, mode):
        return lsj.TrainState.create(apply_fn=None, params=_params(), tx=self.tx(mode))

    def step_one(self, mode, carry, grads):
        return carry.apply_gradients(grads=grads)

    def view(self, carry, mode):
        return _view(carry.params, carry.opt_state, int(carry.step))


class _Net(nnx.Module):
    def __init__(self):
        for k in NAMES:
            setattr(self, k, nnx.Param(jnp.asarray(PARAMS[k])))


class Nnx(FrontEnd):
    def __init__(self, policy, every_k):
        self.every_k = every_k
        self.graphdefs = {}
        super().__init__(policy)

    def init_one(self, mode):
        model = _Net()
        opt = lsj.LossScaleOptimizer(model, self.tx(mode), wrt=nnx.Param)
        graphdef, state = nnx.split((model, opt))
        self.graphdefs[mode] = graphdef
        return state

    def step_one(self, mode, carry, grads):
        model, opt = nnx.merge(self.graphdefs[mode], carry)
        grad_state = jax.tree_util.tree_map(
            lambda v, g: v.replace(g),
            nnx.state(model, nnx.Param),
            nnx.State(grads),
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        )
        opt.update(model, grad_state)
        return nnx.split((model, opt))[1]

    def view(self, carry, mode):
        model, opt = nnx.merge(self.graphdefs[mode], carry)
        params = {k: getattr(model, k)[...] for k in NAMES}
        return _view(params, nnx.as_pure(opt.opt_state), int(opt.step[...]))


class MultiOptimizer(FrontEnd):
    groups = [[0, 2], [1]]  # labels: b, w -> "x"; h -> "y"

    def build_tx(self, mode):
        return compat.torch.multi_optimizer(
            {"x": counting_sgd(), "y": counting_sgd()},
            {"b": "x", "h": "y", "w": "x"},
            self.policy,
            overflow=mode,
        )


FRONT_ENDS = {
    "optax": lambda p: FrontEnd(p),
    "fused": lambda p: Fused(p),
    "accumulation_1": lambda p: Accumulation(p, 1),
    "accumulation_3": lambda p: Accumulation(p, 3),
    "train_state": lambda p: Linen(p, 1),
    "train_state_accumulation_2": lambda p: Linen(p, 2),
    "nnx": lambda p: Nnx(p, 1),
    "nnx_accumulation_4": lambda p: Nnx(p, 4),
    "multi_optimizer": lambda p: MultiOptimizer(p),
}


@functools.cache
def front_end(name: str, policy_name: str) -> FrontEnd:
    if name == "accumulation_1":
        # every_k=1 builds loss_scaling itself (build_tx), as the Optax path does: the same
        # transformations and the same compiled step, so the Optax path's is run, not a copy.
        return front_end("optax", policy_name)
    return FRONT_ENDS[name](POLICIES[policy_name])


def test_each_front_end_traces_its_step_once():
    """The runs of one front-end share one compiled step (the property test's cost)."""
    traced = front_end("train_state_accumulation_2", "dynamic")
    grads = {k: jnp.asarray(np.zeros(PARAMS[k].shape, GRAD_DTYPES[k])) for k in NAMES}
    for _ in range(3):
        traced.step(traced.init(), grads)
    assert traced.step._cache_size() == 1


# ------------------------------------------------------------------ data

FAULTS = [np.inf, -np.inf, np.nan, 65504.0, -65504.0, 1.0e5]


@st.composite
def micro_batches(draw, allow_nan: bool):
    """A list of micro-batches: per leaf, multiples of 1/8 in [-4, 4] (``-0.0`` among
    them), and maybe one fault at one element."""
    n = draw(st.integers(1, 9))
    batches = []
    for _ in range(n):
        grads = {}
        for k, size in zip(NAMES, SIZES, strict=True):
            values = draw(st.lists(st.integers(-32, 32), min_size=size, max_size=size))
            g = np.array(values, np.float64).reshape(PARAMS[k].shape) / 8.0
            g[g == 0] = -0.0 if draw(st.booleans()) else 0.0
            grads[k] = g.astype(GRAD_DTYPES[k])
        if draw(st.booleans()):
            faults = FAULTS if allow_nan else [f for f in FAULTS if not np.isnan(f)]
            value = draw(st.sampled_from(faults))
            leaf = draw(st.sampled_from(NAMES))
            index = draw(st.integers(0, grads[leaf].size - 1))
            if value == 1.0e5 and GRAD_DTYPES[leaf] == np.float16:
                value = np.inf  # past float16's range: what a float16 backward pass writes
            with np.errstate(over="ignore"):
                grads[leaf].reshape(-1)[index] = value
        batches.append(grads)
    return batches


# ------------------------------------------------------------------ comparison


def _same(a: Any, b: Any, what: str, ulps: int = 0, magnitude: Any = None) -> None:
    """Bit for bit (dtype, shape, bytes); a nan equals any nan. ``ulps``: a float may differ
    from the reference ``b`` by that many units in the last place of ``magnitude`` (the
    spacing at ``|b|`` where None)."""
    x, y = np.asarray(a), np.asarray(b)
    assert x.dtype == y.dtype and x.shape == y.shape, (
        f"{what}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}"
    )
    if np.issubdtype(x.dtype, np.floating):
        both_nan = np.isnan(x) & np.isnan(y)
        xb = np.where(both_nan, 0, x).view(f"u{x.itemsize}")
        yb = np.where(both_nan, 0, y).view(f"u{y.itemsize}")
        close = xb == yb
        if ulps:
            with np.errstate(invalid="ignore"):  # inf and nan: compared by their bits above
                gap = np.abs(x.astype(np.float64) - y.astype(np.float64))
                size = np.abs(y) if magnitude is None else np.asarray(magnitude, x.dtype)
                close |= gap <= ulps * np.spacing(size).astype(np.float64)
        assert np.all(close), f"{what}: {x!r} vs {y!r}"
    else:
        assert np.array_equal(x, y), f"{what}: {x!r} vs {y!r}"


def _compare(
    view: View, ref: Reference, where: str, param_ulps: int = 0, before: Any = None
) -> None:
    """``before``: the parameters the step started from, where ``param_ulps``: the tolerance
    is in units of the larger of them and the result (the size of the update's terms)."""
    for i, name in enumerate(NAMES):
        size = None if before is None else np.maximum(np.abs(before[i]), np.abs(ref.params[i]))
        _same(view.params[i], ref.params[i], f"{where}: params {name}", param_ulps, size)
        owner = next(r for r, g in zip(ref.inner, ref.groups, strict=True) if i in g)
        _same(view.last[i], owner.last[i], f"{where}: inner state's last gradient {name}")
    assert view.counts == [r.count for r in ref.inner], f"{where}: inner counts"
    ls, rs = view.loss_scale, ref.ls
    _same(ls.scale, np.float32(rs.scale), f"{where}: scale")
    for f in (
        "growth_count",
        "hysteresis_count",
        "total_steps",
        "overflow_steps",
        "skipped_steps",
        "margin",
    ):
        _same(getattr(ls, f), np.int32(getattr(rs, f)), f"{where}: {f}")
    for f in ("last_overflow", "last_skipped", "stuck"):
        _same(getattr(ls, f), np.bool_(getattr(rs, f)), f"{where}: {f}")
    _same(ls.recent_overflow_rate, rs.recent_overflow_rate, f"{where}: recent_overflow_rate")
    _same(ls.range_peak, np.float32(rs.range_peak), f"{where}: range_peak")
    _same(view.record, ref.record, f"{where}: leaf_overflow")
    expected = ref.metrics()
    assert set(view.metrics) == set(expected), where
    for k, v in expected.items():
        _same(view.metrics[k], np.asarray(v, view.metrics[k].dtype), f"{where}: metrics[{k}]")
    if view.applied is not None:
        assert view.applied == ref.applied_steps, f"{where}: train state step"


def _to_device(grads: dict) -> dict:
    return {k: jnp.asarray(v) for k, v in grads.items()}


@functools.cache
def front_end_other(name: str, policy_name: str) -> FrontEnd:
    """A front-end of its own (its own jitted step), traced with the other formulation."""
    return FRONT_ENDS[name](POLICIES[policy_name])


def other_formulation() -> str:
    """The skip's formulation the cells above do not take: the select where this run takes
    the conditional (XLA:CPU's own), the conditional where it takes the select (a GPU, or
    LOSSSCALE_JAX_SKIP=select, as CI runs the suite)."""
    return "cond" if skip_formulation() == "select" else "select"


@pytest.mark.parametrize("policy_name", sorted(POLICIES))
@pytest.mark.parametrize("name", sorted(FRONT_ENDS))
def test_front_end_matches_the_reference(name, policy_name):
    check_front_end(front_end(name, policy_name), name, policy_name)


# The skip's other formulation (a select per leaf or one lax.cond; XLA:GPU takes the first,
# XLA:CPU the second: lossscale_jax/engine/_skip.py), forced: every front-end but the Optax path's
# twin (accumulation_1) against the same reference, step for step, so that every run holds
# both formulations to it (CI runs the whole suite under the select). Three policies of
# different kinds (counters, a measured range, none moving): the formulation selects the same
# operands whatever the policy wrote.
@pytest.mark.parametrize("policy_name", ["dynamic", "headroom", "static_4"])
@pytest.mark.parametrize("name", [n for n in sorted(FRONT_ENDS) if n != "accumulation_1"])
def test_the_other_formulation_matches_the_reference(name, policy_name):
    with _skip.formulation(other_formulation()):
        check_front_end(front_end_other(name, policy_name), name, policy_name)


# The division's rounding, perturbed as an approximate division (XLA:GPU's) perturbs it: the
# backend's quotient moved one or two ulps either way before the library corrects it
# (_division.skewed), on every front-end, each under one of the four skews in turn. The
# tolerant policy divides twice per step (its overflow ratio, and the recent overflow rate
# every policy keeps); with the correction off, every quotient that is not 0 comes out wrong.
SKEWS = (-2, -1, 1, 2)


@functools.cache
def front_end_skewed(name: str, skew: int) -> FrontEnd:
    """A front-end of its own (its own jitted step), traced with the division skewed."""
    return FRONT_ENDS[name](POLICIES["tolerant"])


@pytest.mark.parametrize(
    ("name", "skew"), [(n, SKEWS[i % len(SKEWS)]) for i, n in enumerate(sorted(FRONT_ENDS))]
)
def test_a_skewed_division_still_matches_the_reference(name, skew):
    with _division.skewed(skew):
        check_front_end(front_end_skewed(name, skew), name, "tolerant")


def param_ulps(front: FrontEnd) -> int:
    """How far the parameters may be from the reference, in units in the last place.

    0 but for a window of micro-batches (``every_k > 1``) under the select formulation: both
    branches in one program, XLA fuses the window's mean (the sum times 1/k, rounded) into the
    inner update and the parameter add, folds the two constant factors and contracts the
    multiply and add into one fused multiply-add, which skips the mean's rounding (XLA:CPU,
    seen 1 ulp off with k = 3; XLA:GPU contracts alike). The fused multiply-add keeps the
    product's rounding error, which is in units of the update's size, not of the result's (a
    parameter stepped to 0 came out 4.7e-10): each window is held within 2 ulps of the larger
    of the parameter before and after (the product's rounding, half an ulp of the update, at
    most twice that size; the sum's, in either), against the reference's step from the same
    parameters (the reference takes the step's parameters after the comparison, so the
    differences do not add up over windows). Everything else, the loss-scale state, the
    counters and the gradient handed to the inner transformation included, stays bit for bit.
    """
    return 2 if front.every_k > 1 and skip_formulation() == "select" else 0


def run_against_reference(front: FrontEnd, name: str, policy_name: str, batches: list) -> None:
    """``batches`` through ``front`` and the reference, in every mode, compared after each."""
    leaves = [PARAMS[k] for k in NAMES]
    ulps = param_ulps(front)
    carry = front.init()
    refs = {
        m: Reference(
            POLICIES[policy_name], leaves, mode=m, every_k=front.every_k, groups=front.groups
        )
        for m in MODES
    }
    for t, grads in enumerate(batches):
        carry = front.step(carry, _to_device(grads))
        for m in MODES:
            before = [np.array(p) for p in refs[m].params]
            refs[m].step([grads[k] for k in NAMES])
            where = f"{name}/{policy_name}/{m} call {t}"
            view = front.view(carry[m], m)
            _compare(view, refs[m], where, ulps, before if ulps else None)
            if ulps:  # each window within ulps of the reference's step from the same point
                refs[m].params = [np.array(p) for p in view.params]


def check_front_end(front: FrontEnd, name: str, policy_name: str) -> None:
    allow_nan = not POLICIES[policy_name].measures_range  # the range of a nan: unspecified

    @settings(max_examples=6, deadline=None)
    @given(micro_batches(allow_nan))
    def check(batches):
        run_against_reference(front, name, policy_name, batches)

    check()


def _landing_batches(every_k: int) -> list:
    """Windows of small gradients, then one whose h gradient is 65504 where h is -64000: the
    update -0.5 * 65504 / scale lands -inf at a scale under about 21 (NoScale, StaticScale(4),
    DynamicScale at 2**4) in ieee mode, where 65504 is no overflow; then good windows again."""
    small = {k: np.full(PARAMS[k].shape, 0.25, GRAD_DTYPES[k]) for k in NAMES}
    far = {k: v.copy() for k, v in small.items()}
    far["h"].reshape(-1)[2] = 65504.0
    return [small] * every_k + [far] * every_k + [small] * (2 * every_k)


# An update that cannot land (metrics' "unlanded"): skipped and stuck, not an overflow, the
# policy's scale and counters kept; every front-end against the reference, step for step.
@pytest.mark.parametrize("policy_name", ["no_scale", "static_4", "dynamic", "static_8_no_skip"])
@pytest.mark.parametrize("name", sorted(FRONT_ENDS))
def test_an_update_that_cannot_land_matches_the_reference(name, policy_name):
    front = front_end(name, policy_name)
    batches = _landing_batches(front.every_k)
    run_against_reference(front, name, policy_name, batches)
    ref = Reference(
        POLICIES[policy_name],
        [PARAMS[k] for k in NAMES],
        mode="ieee",
        every_k=front.every_k,
        groups=front.groups,
    )
    unlanded = []
    for grads in batches:
        ref.step([grads[k] for k in NAMES])
        unlanded.append(ref.metrics()["unlanded"])
    assert any(unlanded), "the batches must reach the unlanded path"  # the test's premise


def _fused_step():
    tx = lsj.loss_scaling(optax.adam(1e-3), lsj.DynamicScale())
    params = {"a": jnp.ones(3), "b": jnp.ones((2, 2))}
    grads = jax.tree_util.tree_map(lambda p: p.astype(jnp.float16), params)

    def step(g, s, p):
        return lsj.apply_gradients(tx, g, s, p)

    return step, (grads, tx.init(params), params)


def test_the_formulation_is_the_one_asked_for():
    # The jaxpr: one cond in a process whose platforms all take the conditional (this CPU
    # suite's), no cond and a select per output leaf under the select formulation.
    step, args = _fused_step()
    with _skip.formulation("cond"):
        conditional = str(jax.make_jaxpr(step)(*args))
    with _skip.formulation("select"):
        selected = str(jax.make_jaxpr(step)(*args))
    assert conditional.count(" cond[") == 1 and " cond[" not in selected
    branch_outputs = jax.tree_util.tree_leaves((args[2], args[1].inner_state))
    picks = selected.count("_where") + selected.count("select_n")  # jnp.where's, inlined or not
    assert picks >= len(branch_outputs)
    if _skip.here() == {"cond"} and _skip.current() is None:  # no LOSSSCALE_JAX_SKIP either
        assert str(jax.make_jaxpr(step)(*args)) == conditional
    with pytest.raises(ValueError, match="formulation must be one of"):
        with _skip.formulation("where"):
            pass


def test_each_platform_compiles_its_own_formulation(monkeypatch):
    """A process with platforms of both formulations (a GPU beside the CPU; ``_skip.here``
    says which this one has) traces both, and what a platform compiles is its table entry's:
    the CPU's entry decides the conditionals of XLA:CPU's program. Good and skipped steps give
    the same bits either way."""
    monkeypatch.setattr(_skip, "here", lambda: {"cond", "select"})
    monkeypatch.delenv(_skip.ENV, raising=False)  # each platform's own, whatever the run forces
    bad = np.array([1.0, np.inf, 2.0], np.float16)
    outputs = []
    for cpu_takes, conditionals in (("cond", 1), ("select", 0)):
        monkeypatch.setitem(_skip.BY_PLATFORM, "cpu", cpu_takes)
        step, (grads, state, params) = _fused_step()  # a new function: traced afresh
        jaxpr = str(jax.make_jaxpr(step)(grads, state, params))
        assert "platform_index" in jaxpr, jaxpr  # both formulations, chosen at lowering
        compiled = jax.jit(step).lower(grads, state, params).compile()
        assert compiled.as_text().count(" conditional(") == conditionals, cpu_takes
        params, state = compiled(grads, state, params)
        assert not bool(state.loss_scale.last_skipped)
        kept, skipped = compiled({**grads, "a": jnp.asarray(bad)}, state, params)
        assert bool(skipped.loss_scale.last_skipped)
        pairs = zip(jax.tree_util.tree_leaves(kept), jax.tree_util.tree_leaves(params), strict=True)
        for x, y in pairs:
            _same(x, y, f"{cpu_takes}: a skipped step keeps the parameters")
        outputs.append(jax.tree_util.tree_leaves((params, state, kept, skipped)))
    for x, y in zip(*outputs, strict=True):
        _same(x, y, "cond against select")
