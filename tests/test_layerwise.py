"""Per-layer loss scaling against a NumPy model of its rule, per layer and per device.

The reference (``ReferenceLayerwise``, below) runs ``reference_scalers.ReferenceHeadroom`` per
segment on per-segment ranges and overflow flags that this file computes in NumPy from the
scaled gradients and the taps (not from the engine's check). The scaled gradients themselves
are checked against plain float16 gradients at each segment's scale.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, serialization
from helpers import assert_bits_equal
from reference_scalers import ReferenceHeadroom

import lossscale_jax as lsj
from lossscale_jax import layerwise as lw

# Slow (make test-fast leaves it out): each test compiles per-layer steps.
pytestmark = pytest.mark.slow

F32 = np.float32
LIMIT = F32(65504.0)
POLICY = lsj.HeadroomScale(init_scale=2.0**8, margin_interval=4, window=3)
GAINS = (64.0, 1.0 / 256, 1.0)  # per layer: the backward signal's magnitudes spread apart


class ReferenceLayerwise:
    """The rule of ``layerwise_scaling``: HeadroomScale per segment; on an overflow only the
    overflowed segment closest to the loss (the culprit) steps, the others keep their state."""

    def __init__(self, policy: lsj.HeadroomScale, n: int):
        self.segments = [ReferenceHeadroom(policy) for _ in range(n + 1)]
        self.attributed = [0] * (n + 1)

    def step(self, overflowed: list[bool], amax: list[float]) -> None:
        n = len(self.segments) - 1
        if any(overflowed):
            culprit = max(s for s in range(n + 1) if overflowed[s])
            self.segments[culprit].step(True, math.inf)
            self.attributed[culprit] += 1
        else:
            for s, seg in enumerate(self.segments):
                seg.step(False, F32(amax[s]))

    @property
    def scales(self) -> list[float]:
        return [float(s.scale) for s in self.segments]


def loss_fn(params, batch):
    x, y = batch
    h = x.astype(jnp.float16)
    for i, gain in enumerate(GAINS):
        w = params[f"w{i}"].astype(jnp.float16)
        h = lsj.tap(jnp.tanh(h @ w) * jnp.float16(gain), f"l{i}")
    out = h @ params["head"].astype(jnp.float16)
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def make_params(seed=0):
    key = jax.random.PRNGKey(seed)
    p = {f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (8, 8)) for i in range(3)}
    p["head"] = jax.random.normal(jax.random.fold_in(key, 9), (8, 2))
    return p


def batch(t, n=16):
    x = jax.random.normal(jax.random.PRNGKey(100 + t), (n, 8))
    return x, jnp.sin(x[:, :2])


PARAMS = make_params()
LAYERS = lw.discover(loss_fn, PARAMS, batch(0))
TX = lw.layerwise_scaling(optax.adam(1e-3), LAYERS, POLICY)


def test_layer_map_of_a_chain():
    assert LAYERS.names == ("l0", "l1", "l2")
    # tree_leaves order: head, w0, w1, w2; the head passes no tap (the loss's segment)
    assert LAYERS.paths == ("['head']", "['w0']", "['w1']", "['w2']")
    assert LAYERS.segments == (3, 0, 1, 2)
    assert LAYERS.layer_of("['w1']") == "l1" and LAYERS.layer_of("['head']") == "loss"


def _step_fn(inject):
    @jax.jit
    def step(params, opt_state, x, y, fault):
        def scaled(p):
            return lsj.scale_loss(loss_fn(p, (x, y)), opt_state)

        _, grads, taps = lw.value_and_grad(scaled, LAYERS, opt_state)(params)
        if inject:  # a fault written into one leaf's scaled gradient (leaf index, or -1)
            grads = {
                k: jnp.where(fault == i, jnp.full_like(g, jnp.inf), g)
                for i, (k, g) in enumerate(sorted(grads.items()))
            }
        new_params, new_state = lsj.apply_gradients(TX, grads, opt_state, params, taps=taps)
        return new_params, new_state, grads, taps

    return step


STEP = _step_fn(True)


def numpy_check(grads, taps, scales):
    """Per segment: overflowed, and the range at scale 1, recomputed in NumPy."""
    n = len(LAYERS.names)
    over, amax = [False] * (n + 1), [F32(0.0)] * (n + 1)
    for i, g in enumerate(jax.tree_util.tree_leaves(grads)):
        s = LAYERS.segments[i]
        a = np.abs(np.asarray(g, np.float32))
        over[s] |= not np.all(np.isfinite(a))
        amax[s] = max(amax[s], F32(a.max() / (F32(scales[s]) * LIMIT)))
    peaks, bad = taps.max_abs(), taps.nonfinite()
    limits = {
        k: F32(np.finfo(np.dtype(d)).max) for k, d in zip(taps.names, taps.dtypes, strict=True)
    }
    for j, name in enumerate(LAYERS.names):
        u = F32(float(peaks[name]) / (F32(scales[j + 1]) * limits[name]))
        amax[j], amax[j + 1] = max(amax[j], u), max(amax[j + 1], u)
        over[j + 1] |= float(bad[name]) > 0
    with np.errstate(over="ignore"):  # a float32 loss's limit times the scale: inf, u = 0
        u = F32(float(peaks["loss"]) / (F32(scales[n]) * limits["loss"]))
    amax[n] = max(amax[n], u)
    over[n] |= float(bad["loss"]) > 0
    return over, amax


def test_rule_against_the_numpy_model_with_faults():
    params, opt_state = PARAMS, TX.init(PARAMS)
    ref = ReferenceLayerwise(POLICY, len(LAYERS.names))
    # faults: leaf index per step (-1: none); leaves sorted: head(3), w0(0), w1(1), w2(2)
    faults = [-1, -1, 2, -1, -1, 1, 3, -1, -1, -1, 0, -1, -1, -1]
    skipped = 0
    for t, fault in enumerate(faults):
        x, y = batch(t)
        scales = np.asarray(opt_state.layers.scale)
        new_params, opt_state, grads, taps = STEP(params, opt_state, x, y, fault)
        over, amax = numpy_check(grads, taps, scales)
        ref.step(over, amax)
        np.testing.assert_array_equal(np.asarray(opt_state.layers.scale), ref.scales, f"{t}")
        np.testing.assert_array_equal(
            np.asarray(opt_state.layers.margin), [s.margin for s in ref.segments]
        )
        np.testing.assert_array_equal(
            np.asarray(opt_state.layers.range_peak), [s.peak for s in ref.segments]
        )
        np.testing.assert_array_equal(np.asarray(opt_state.layers.overflow_steps), ref.attributed)
        assert bool(opt_state.loss_scale.last_skipped) == any(over)
        assert float(opt_state.loss_scale.scale) == ref.scales[-1]
        if any(over):
            skipped += 1
            assert_bits_equal(new_params, params, "skipped")
        params = new_params
    # the 4 faults, and any overflow of the adaptation itself (the reference saw them too)
    assert skipped >= 4 and int(lsj.metrics(opt_state)["skipped_steps"]) == skipped
    # the scales spread apart: the layers' gradients do (GAINS)
    assert len(set(ref.scales)) > 1


def test_scaled_gradients_are_plain_float16_gradients_at_each_segments_scale():
    # Powers of two commute with float16 arithmetic (away from subnormals and overflow):
    # a leaf of segment s gets exactly the plain float16 gradient at global scale C_s.
    params, state = PARAMS, TX.init(PARAMS)
    for t in range(3):  # scales adapted to these gradients
        params, state, _, _ = STEP(params, state, *batch(t), -1)
    scales = state.layers.scale
    assert len(set(np.asarray(scales).tolist())) > 1
    x, y = batch(1)

    def scaled(p, st):
        return lsj.scale_loss(loss_fn(p, (x, y)), st)

    @jax.jit
    def layered(params, state):
        return lw.value_and_grad(lambda p: scaled(p, state), LAYERS, state)(params)[1:]

    grads, taps = layered(params, state)
    leaves = jax.tree_util.tree_leaves(grads)
    compared = 0
    plain_grad = jax.jit(jax.grad(scaled))
    for s in range(4):
        plain_state = lsj.HeadroomScale(init_scale=float(scales[s])).init()
        plain = jax.tree_util.tree_leaves(plain_grad(params, plain_state))
        for i, seg in enumerate(LAYERS.segments):
            # at a larger global scale the layers nearer the loss can overflow: compare
            # where the plain float16 pass stays finite
            if seg == s and bool(jnp.all(jnp.isfinite(plain[i]))):
                np.testing.assert_allclose(leaves[i], plain[i], rtol=2e-3, err_msg=f"{s} {i}")
                compared += 1
    assert compared >= 2
    # tx.update divides each leaf by its own segment's scale (exact: powers of two)
    sgd = lw.layerwise_scaling(optax.sgd(1.0), LAYERS, POLICY)
    updates, _ = jax.jit(sgd.update)(grads, state, params, taps=taps)
    for i, (k, g) in enumerate(sorted(grads.items())):
        want = -(np.asarray(g, np.float32) / np.float32(scales[LAYERS.segments[i]]))
        np.testing.assert_array_equal(np.asarray(updates[k]), want, err_msg=k)


def test_optax_path_fused_and_train_state_agree_bit_for_bit():
    x, y = batch(2)
    opt_state = TX.init(PARAMS)

    def grads_and_taps(st):
        return lw.value_and_grad(lambda p: lsj.scale_loss(loss_fn(p, (x, y)), st), LAYERS, st)(
            PARAMS
        )[1:]

    grads, taps = grads_and_taps(opt_state)
    fused_params, fused_state = lsj.apply_gradients(TX, grads, opt_state, PARAMS, taps=taps)
    updates, optax_state = TX.update(grads, opt_state, PARAMS, taps=taps)
    assert_bits_equal(optax.apply_updates(PARAMS, updates), fused_params, "optax vs fused")
    assert_bits_equal(optax_state, fused_state, "states")
    ts = lsj.TrainState.create(apply_fn=None, params=PARAMS, tx=TX)
    ts = ts.apply_gradients(grads=grads, taps=taps)
    assert_bits_equal(ts.params, fused_params, "TrainState")
    assert int(ts.step) == 1
    # flax serialization round trip of the state
    restored = serialization.from_state_dict(
        TX.init(PARAMS), serialization.to_state_dict(fused_state)
    )
    assert_bits_equal(restored, fused_state, "checkpoint")


@pytest.mark.multidevice
def test_per_device_under_pmap_one_decision_one_all_reduce():
    n_dev = 4
    tx = lw.layerwise_scaling(optax.sgd(0.1), LAYERS, POLICY, axis_name="b")
    opt_state = tx.init(PARAMS)
    xs = jnp.stack([batch(t)[0] for t in range(n_dev)])
    ys = jnp.stack([batch(t)[1] for t in range(n_dev)])
    faults = jnp.asarray([-1, -1, 2, -1])  # device 2 overflows in w1 (segment 1)

    def step(x, y, fault):
        def scaled(p):
            return lsj.scale_loss(loss_fn(p, (x, y)), opt_state)

        _, grads, taps = lw.value_and_grad(scaled, LAYERS, opt_state)(PARAMS)
        grads = {
            k: jnp.where(fault == i, jnp.full_like(g, jnp.inf), g)
            for i, (k, g) in enumerate(sorted(grads.items()))
        }
        return tx.update(grads, opt_state, PARAMS, taps=taps)[1], grads, taps

    mapped = jax.pmap(step, axis_name="b")
    state, grads, taps = mapped(xs, ys, faults)
    # every device took the same decision and holds the same state
    for leaf in jax.tree_util.tree_leaves(state):
        assert np.all(np.asarray(leaf) == np.asarray(leaf)[0])
    assert bool(state.loss_scale.last_skipped[0])
    assert np.asarray(state.layers.overflow_steps)[0].tolist() == [0, 1, 0, 0]
    # a clean run: each device's check recomputed in NumPy, reduced by max
    state, grads, taps = mapped(xs, ys, jnp.full([n_dev], -1))
    scales = np.asarray(opt_state.layers.scale)
    per_device = [
        numpy_check(
            jax.tree_util.tree_map(lambda g, d=d: g[d], grads),
            jax.tree_util.tree_map(lambda v, d=d: v[d], taps),
            scales,
        )[1]
        for d in range(n_dev)
    ]
    amax = np.max(np.asarray(per_device, np.float32), axis=0)
    ref = ReferenceLayerwise(POLICY, 3)
    ref.step([False] * 4, list(amax))
    np.testing.assert_array_equal(np.asarray(state.layers.scale)[0], ref.scales)
    hlo = mapped.lower(xs, ys, faults).compile().as_text()
    assert hlo.count(" all-reduce(") + hlo.count(" all-reduce-start(") == 1


def test_nnx_optimizer_runs_it():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(8, 8, dtype=jnp.float16, rngs=rngs)
            self.b = nnx.Linear(8, 2, dtype=jnp.float16, rngs=rngs)

        def __call__(self, x):
            return self.b(jnp.tanh(self.a(x)))

    net = Net(nnx.Rngs(0))
    x, y = batch(3)
    graphdef, params = nnx.split(net, nnx.Param)

    def tapped(p, b):  # the layer taps: each Linear's output, by name
        m = nnx.merge(graphdef, p)
        h = lsj.tap(m.a(b[0].astype(jnp.float16)), "a")
        out = lsj.tap(m.b(jnp.tanh(h)), "b")
        return jnp.mean((out.astype(jnp.float32) - b[1]) ** 2)

    layers = lw.discover(tapped, params, (x, y))
    assert layers.names == ("a", "b")
    opt = lsj.LossScaleOptimizer(net, lw.layerwise_scaling(optax.sgd(0.1), layers), wrt=nnx.Param)

    @nnx.jit
    def step(net, opt):
        state = nnx.as_pure(opt.opt_state)
        params = nnx.state(net, nnx.Param)
        _, grads, taps = lw.value_and_grad(
            lambda p: lsj.scale_loss(tapped(p, (x, y)), state), layers, state
        )(params)
        opt.update(net, grads, taps=taps)

    before = nnx.as_pure(nnx.state(net, nnx.Param))
    step(net, opt)
    after = nnx.as_pure(nnx.state(net, nnx.Param))
    assert int(opt.step[...]) == 1
    assert not all(
        bool(jnp.all(a == b))
        for a, b in zip(
            jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after), strict=True
        )
    )


def test_layer_maps_refused():
    def tied(p, b):  # the same weight before and after the tap
        h = lsj.tap(b[0] @ p["w"], "t")
        return jnp.sum(h @ p["w"].T)

    p = {"w": jnp.ones((3, 3))}
    with pytest.raises(lsj.errors.TapError, match="different layer taps on different paths"):
        lw.discover(tied, p, (jnp.ones((2, 3)),))

    def residual_branch(p, b):  # a tap on one branch of a residual
        x = b[0]
        return jnp.sum(x @ p["w"] + lsj.tap(jnp.tanh(x @ p["w"]), "branch"))

    with pytest.raises(lsj.errors.TapError, match="different layer taps"):
        lw.discover(residual_branch, p, (jnp.ones((2, 3)),))

    def scanned(p, b):
        def body(h, _):
            return lsj.tap(jnp.tanh(h @ p["w"]), "s"), None

        return jnp.sum(jax.lax.scan(body, b[0], None, length=3)[0])

    with pytest.raises(lsj.errors.TapError, match="inside 'scan'"):
        lw.discover(scanned, p, (jnp.ones((2, 3)),))
    with pytest.raises(lsj.errors.TapError, match="found no layer tap"):
        lw.discover(lambda p, b: jnp.sum(b[0] @ p["w"]), p, (jnp.ones((2, 3)),))


def test_arguments_and_taps_used_wrongly():
    with pytest.raises(TypeError, match="adapts each layer by HeadroomScale's rule"):
        lw.layerwise_scaling(optax.sgd(0.1), LAYERS, lsj.DynamicScale())
    with pytest.raises(TypeError, match="layers must be the LayerMap"):
        lw.layerwise_scaling(optax.sgd(0.1), ("l0",))  # type: ignore[arg-type]
    opt_state = TX.init(PARAMS)
    x, y = batch(0)
    grads = jax.grad(lambda p: loss_fn(p, (x, y)))(PARAMS)
    with pytest.raises(lsj.errors.TapError, match="per-layer scaling needs taps="):
        TX.update(grads, opt_state, PARAMS)
    _, _, plain_taps = lsj.taps.value_and_grad(lambda p: loss_fn(p, (x, y)))(PARAMS)
    with pytest.raises(lsj.errors.TapError, match="recorded with factors for"):
        TX.update(grads, opt_state, PARAMS, taps=plain_taps)


def test_one_trace_and_no_host_sync():
    params, opt_state = PARAMS, TX.init(PARAMS)
    none = jnp.asarray(-1)
    batches = [batch(t) for t in range(4)]
    params, opt_state, _, _ = STEP(params, opt_state, *batches[0], none)
    traced = STEP._cache_size()
    with jax.transfer_guard("disallow"):
        for x, y in batches[1:]:
            params, opt_state, _, _ = STEP(params, opt_state, x, y, none)
    assert STEP._cache_size() == traced


def test_accumulation_folds_micro_batches_per_segment():
    k = 3
    tx = lw.layerwise_scaling(optax.sgd(1.0), LAYERS, POLICY, every_k=k)
    opt_state = tx.init(PARAMS)
    ref = ReferenceLayerwise(POLICY, len(LAYERS.names))

    @jax.jit
    def micro(opt_state, x, y, fault):
        def scaled(p):
            return lsj.scale_loss(loss_fn(p, (x, y)), opt_state)

        _, grads, taps = lw.value_and_grad(scaled, LAYERS, opt_state)(PARAMS)
        grads = {
            k: jnp.where(fault == i, jnp.full_like(g, jnp.inf), g)
            for i, (k, g) in enumerate(sorted(grads.items()))
        }
        updates, new_state = tx.update(grads, opt_state, PARAMS, taps=taps)
        return updates, new_state, grads, taps

    windows = [[-1, -1, -1], [-1, 1, -1], [-1, -1, -1]]  # the second window: w0 overflows
    for faults in windows:
        scales = np.asarray(opt_state.layers.scale)
        over, amax, good = [False] * 4, [F32(0.0)] * 4, []
        for t, fault in enumerate(faults):
            updates, opt_state, grads, taps = micro(opt_state, *batch(t), fault)
            o, a = numpy_check(grads, taps, scales)
            over = [p or q for p, q in zip(over, o, strict=True)]
            amax = [max(p, q) for p, q in zip(amax, a, strict=True)]
            if not any(o):
                good.append(
                    {
                        key: np.asarray(g, np.float32) / np.float32(scales[LAYERS.segments[i]])
                        for i, (key, g) in enumerate(sorted(grads.items()))
                    }
                )
            if t < k - 1:  # inside the window: no update, scales unchanged
                assert all(not np.any(np.asarray(u)) for u in jax.tree_util.tree_leaves(updates))
                np.testing.assert_array_equal(np.asarray(opt_state.layers.scale), scales)
        ref.step(over, amax)
        np.testing.assert_array_equal(np.asarray(opt_state.layers.scale), ref.scales)
        if any(over):
            assert bool(opt_state.loss_scale.last_skipped)
        else:
            inv = np.float32(1.0 / k)
            for key in PARAMS:
                want = -(np.sum([g[key] for g in good], axis=0, dtype=np.float32) * inv)
                np.testing.assert_allclose(np.asarray(updates[key]), want, rtol=1e-6)


def test_layer_map_of_bfloat16_and_python_float_parameters():
    # Every floating leaf gets the segment of the first tap its gradient passes, whatever
    # its floating dtype (bfloat16 is not a NumPy floating type) or container.
    def loss(p, x):
        h = lsj.tap(jnp.tanh(x @ p["w"].astype(jnp.float32)) * p["s"], "l0")
        return jnp.sum(h @ p["head"])

    params = {"w": jnp.ones((3, 3), jnp.bfloat16), "s": 2.0, "head": jnp.ones((3, 1))}
    layers = lw.discover(loss, params, jnp.ones((2, 3)))
    assert dict(zip(layers.paths, layers.segments, strict=True)) == {
        "['head']": 1,
        "['s']": 0,
        "['w']": 0,
    }
