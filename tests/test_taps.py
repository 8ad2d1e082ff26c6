"""Taps: the statistics against a float32 reference computed independently, and their plumbing.

The reference cotangent at a boundary is computed without taps: the function is split at the
boundary (``jax.vjp`` of the rest of the network at the activation), or, for Flax modules, a
zero perturbation added to each module's output by an interceptor of this file, differentiated
with ``jax.grad`` (Flax's own ``perturb`` idea). The statistics are then recomputed in NumPy.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from helpers import F16_UNIT_ROUNDOFF, FLOAT16_PARAMS, assert_bits_equal, assert_within_roundings
from jax.sharding import Mesh, PartitionSpec

import lossscale_jax as lsj
from lossscale_jax.engine import _tap_stats as layout

F16_TINY = 2.0**-14
# Two float16 programs that compute the same values (with and without taps, with and without
# remat, the reference's) may place their roundings apart: XLA may keep an intermediate in
# float32 in one and round it to float16 in the other. The roundings on the path to one term of
# a gradient entry: w1's term x * ct_h * (1 - h**2) has ct_h2 (1), ct_h from a 3-term product
# (3 + 1), h from a 6-term product and tanh (6 + 1 + 1), h**2 and 1 - h**2 (2), the product
# with ct_h (1) and the 5-term sum over the batch (5 + 1): 22; w2's term h * ct_h2 has fewer.
GRAD_ROUNDINGS = 24

ALL_REDUCE = re.compile(r"=\s*(\(.*?\)|\S+)\s+all-reduce(?:-start)?\(")


def all_reduces(hlo_text: str) -> list[str]:
    return sorted(
        ", ".join(sorted(re.findall(r"[a-z]+\d*\[[\d,]*\]", s)))
        for s in ALL_REDUCE.findall(hlo_text)
    )


def ref_stats(ct) -> dict[str, float]:
    """The statistics of one cotangent, in NumPy."""
    a = np.abs(np.asarray(ct, np.float64))
    finite = np.isfinite(a)
    nz = finite & (a > 0)
    return {
        "max_abs": float(a[finite].max(initial=0.0)),
        "nonfinite": float((~finite).sum()),
        "underflow_fraction": float((nz & (a < F16_TINY)).sum() / max(nz.sum(), 1)),
    }


def check_against(taps: lsj.TapStats, name: str, ct, index=()) -> None:
    """The tap's statistics against those of ``ct``, a float16 cotangent another program
    computed: equal up to float16 rounding placed differently by the compiler (see
    GRAD_ROUNDINGS): the largest entry within that many roundings, and the count below
    2**-14 off by at most the entries that close to it."""
    want = ref_stats(ct)
    got = {k: float(np.asarray(v)[index]) for k, v in taps.summary()[name].items()}
    assert got["uses"] == 1.0
    assert got["nonfinite"] == want["nonfinite"], name
    rel = GRAD_ROUNDINGS * F16_UNIT_ROUNDOFF
    np.testing.assert_allclose(got["max_abs"], want["max_abs"], rtol=rel, err_msg=name)
    a = np.abs(np.asarray(ct, np.float64))
    nz = np.isfinite(a) & (a > 0)
    near = np.sum(nz & (np.abs(a - F16_TINY) <= rel * F16_TINY))
    assert abs(got["underflow_fraction"] - want["underflow_fraction"]) * max(nz.sum(), 1) <= (
        near + 1e-6
    ), name


# A plain-JAX model in float16 with three boundaries, written twice: tapped, and split at
# the boundaries for the reference.
def layer1(p, x):
    return jnp.tanh(x @ p["w1"].astype(jnp.float16))


def layer2(p, h):
    return h @ p["w2"].astype(jnp.float16)


def head(h2, y):
    return jnp.mean((h2.astype(jnp.float32) - y) ** 2)


def tapped_loss(p, batch, scale):
    x, y = batch
    h = lsj.tap(layer1(p, x), "h")
    h2 = lsj.tap(layer2(p, h), "h2")
    return head(h2, y) * scale


@jax.jit
def reference_cotangents(p, batch, scale):
    x, y = batch
    h = layer1(p, x)
    h2, vjp2 = jax.vjp(lambda h: layer2(p, h), h)
    (ct_h2,) = jax.grad(lambda h2: head(h2, y) * scale, argnums=(0,))(h2)
    (ct_h,) = vjp2(ct_h2)
    return {"h": ct_h, "h2": ct_h2}


def gradient_magnitudes(p, batch, ref):
    """Per gradient entry, the sum of its terms' magnitudes in float64 (|x|.T @ |d|)."""
    x = np.abs(np.asarray(batch[0], np.float64))
    h = np.tanh(np.asarray(batch[0], np.float64) @ np.asarray(p["w1"], np.float64))
    ct_h, ct_h2 = (np.abs(np.asarray(ref[k], np.float64)) for k in ("h", "h2"))
    with np.errstate(invalid="ignore"):  # inf cotangents at 2**30: compared as inf
        return {"w1": x.T @ (ct_h * (1 - h**2)), "w2": np.abs(h).T @ ct_h2}


def make_params(key=0, big=1.0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(key))
    return {
        "w1": jax.random.normal(k1, (6, 8)) * 0.5,
        "w2": jax.random.normal(k2, (8, 3)) * big,
    }


def make_batch(key=1, n=5):
    x = jax.random.normal(jax.random.PRNGKey(key), (n, 6)).astype(jnp.float16)
    return x, jnp.zeros((n, 3))


TAPPED_GRAD = jax.jit(lsj.taps.value_and_grad(tapped_loss))  # compiled once for every scale


@pytest.mark.parametrize("scale", [1.0, 2.0**10, 2.0**30])
def test_stats_match_the_float32_reference(scale):
    # 2**30: the float16 cotangents overflow (inf), counted per entry.
    p, batch = make_params(), make_batch()
    _, grads, taps = TAPPED_GRAD(p, batch, scale)
    assert taps.names == ("h", "h2") and taps.dtypes == ("float16", "float16")
    ref = reference_cotangents(p, batch, scale)
    for name in taps.names:
        check_against(taps, name, ref[name])
    want = jax.grad(tapped_loss)(p, batch, scale)  # no recording: taps are the identity
    # The taps pass the cotangents on unchanged, but the two float16 programs are compiled
    # apart: XLA may round an intermediate to float16 in one and not the other.
    assert_within_roundings(
        grads, want, gradient_magnitudes(p, batch, ref), GRAD_ROUNDINGS, "the gradients"
    )
    if scale == 2.0**30:
        assert bool(taps.overflow())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e5m2", "float32"])
def test_a_value_kept_wider_than_its_dtype_counts_as_the_inf_it_would_round_to(dtype):
    # A compiler may keep a float16 cotangent in float32 inside a fusion (XLA:GPU's excess
    # precision: at 2**30 above, the reference program's float16 cotangent was inf where the
    # tapped program's, kept wide, was not). A tap counts an entry from the magnitude that
    # the dtype would round to inf: checked here against the dtype's own rounding.
    limit = np.float32(layout.rounds_to_inf(dtype))
    if dtype == "float32":
        assert limit == np.inf
        return
    below = np.nextafter(limit, np.float32(0))
    as_dtype = np.asarray(jnp.asarray([limit, below], jnp.float32).astype(dtype), np.float32)
    assert np.isinf(as_dtype[0]) and np.isfinite(as_dtype[1])


def test_one_trace_no_host_sync_and_no_tap_without_recording():
    traces = []

    def loss(p, batch):
        traces.append(1)
        return tapped_loss(p, batch, 1.0)

    step = jax.jit(lsj.taps.value_and_grad(loss))
    p, batch = make_params(), make_batch()
    step(p, batch)
    with jax.transfer_guard("disallow"):
        for _ in range(3):
            _, _, taps = step(p, batch)
    # one trace of the step: discover's abstract trace plus the differentiated one
    assert len(traces) == 2
    assert isinstance(taps.values[0], jax.Array)

    # Outside a recording a tap adds nothing to the program: same jaxpr as without it.
    def untapped(p, batch, scale):
        x, y = batch
        return head(layer2(p, layer1(p, x)), y) * scale

    plain = jax.make_jaxpr(jax.grad(untapped))(p, batch, 1.0)
    marked = jax.make_jaxpr(jax.grad(tapped_loss))(p, batch, 1.0)
    assert str(plain) == str(marked)
    assert "custom_vjp" not in str(marked)


def test_scan_and_remat():
    # A tap in a scan body is one sink used per iteration: the counts add up exactly and
    # max_abs is an upper bound within a factor 2 of the true largest.
    w = jnp.asarray([0.5, 3.0], jnp.float32)
    xs = jnp.asarray([[1.0, 2.0], [3.0, 1.0], [0.25, 0.5]], jnp.float32)

    def f(w, xs):
        def body(c, x):
            h = lsj.tap(jnp.sin(x * w), "s")
            return c + jnp.sum(h * x), None

        return jax.lax.scan(body, 0.0, xs)[0]

    _, _, taps = lsj.taps.value_and_grad(f)(w, xs)
    true_max = float(np.max(np.abs(np.asarray(xs))))  # d c / d h = x
    got = taps.summary()["s"]
    assert float(got["uses"]) == 3.0
    assert true_max <= float(got["max_abs"]) <= 2 * true_max
    nz = float(np.sum(np.asarray(xs) != 0))
    assert float(taps.values[0][layout.NONZERO]) == nz

    p, batch = make_params(), make_batch()
    remat = jax.checkpoint(lambda p, b: tapped_loss(p, b, 2.0**10))
    _, g1, t1 = lsj.taps.value_and_grad(remat)(p, batch)
    _, g2, t2 = lsj.taps.value_and_grad(lambda p, b: tapped_loss(p, b, 2.0**10))(p, batch)
    # Remat recomputes the same float16 forward in another program: the same rounding
    # bound as with and without taps, for the gradients and for the largest cotangents.
    ref = reference_cotangents(p, batch, 2.0**10)
    assert_within_roundings(
        g1, g2, gradient_magnitudes(p, batch, ref), GRAD_ROUNDINGS, "remat grads"
    )
    for name in t2.names:
        got, want = t1.summary()[name], t2.summary()[name]
        assert_within_roundings(
            got["max_abs"], want["max_abs"], want["max_abs"], GRAD_ROUNDINGS, "remat"
        )
        for k in ("uses", "nonfinite", "underflow_fraction"):
            assert float(got[k]) == float(want[k]), (name, k)


@pytest.mark.multidevice
def test_pmap_and_shard_map_per_device():
    n = 4
    p = make_params()
    xs = jax.random.normal(jax.random.PRNGKey(3), (n, 5, 6)).astype(jnp.float16)
    xs = xs * jnp.arange(1, n + 1, dtype=jnp.float16)[:, None, None]  # differ per device
    ys = jnp.zeros((n, 5, 3))
    scale = 2.0**8

    def local(p, x, y):
        return lsj.taps.value_and_grad(tapped_loss)(p, (x, y), scale)[2]

    mapped = jax.pmap(local, in_axes=(None, 0, 0))(p, xs, ys)
    mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
    spec = PartitionSpec("d")
    sharded = jax.jit(
        jax.shard_map(
            lambda p, x, y: jax.tree_util.tree_map(lambda v: v[None], local(p, x[0], y[0])),
            mesh=mesh,
            in_specs=(PartitionSpec(), spec, spec),
            out_specs=spec,
        )
    )(p, xs, ys)
    for d in range(n):
        ref = reference_cotangents(p, (xs[d], ys[d]), scale)
        for name in ("h", "h2"):
            check_against(mapped, name, ref[name], index=d)
            check_against(sharded, name, ref[name], index=d)


class MLP(nn.Module):
    middle: float = 1.0

    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Dense(8, dtype=jnp.float16, name="inp")(x))
        x = nn.Dense(8, dtype=jnp.float16, name="mid")(x * self.middle)
        return nn.Dense(2, dtype=jnp.float16, name="out")(jnp.tanh(x))


def linen_reference(model, variables, x, y, scale):
    """d loss / d (each module's output), by a zero perturbation added by an interceptor."""
    shapes = {}

    def probe(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name == "__call__":
            shapes["/".join(context.module.path) or type(context.module).__name__] = out
        return out

    with nn.intercept_methods(probe):
        model.apply(variables, x)

    def loss(eps):
        def add(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            if context.method_name != "__call__":
                return out
            return out + eps["/".join(context.module.path) or type(context.module).__name__]

        with nn.intercept_methods(add):
            out = model.apply(variables, x)
        return jnp.mean((out.astype(jnp.float32) - y) ** 2) * scale

    zeros = {k: jnp.zeros_like(v) for k, v in shapes.items()}
    return jax.jit(jax.grad(loss))(zeros)


def test_linen_modules_tapped_by_path_without_changing_the_model():
    model = MLP()
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 5)).astype(jnp.float16)
    y = jnp.ones((4, 2))
    variables = model.init(jax.random.PRNGKey(1), x)
    scale = 2.0**12

    def loss(v):
        out = model.apply(v, x)
        return jnp.mean((out.astype(jnp.float32) - y) ** 2) * scale

    _, _, taps = jax.jit(lsj.taps.value_and_grad(loss))(variables)
    assert taps.names == ("inp", "mid", "out", "MLP")
    ref = linen_reference(model, variables, x, y, scale)
    for name in taps.names:
        check_against(taps, name, ref[name])
    # modules=False: only explicit taps (none here)
    assert len(lsj.taps.value_and_grad(loss, modules=False)(variables)[2]) == 0


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(5, 8, dtype=jnp.float16, rngs=rngs)
        self.out = nnx.Linear(8, 2, dtype=jnp.float16, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.inp(x)))


def test_nnx_modules_tapped_by_path_and_fed_to_the_optimizer():
    model = NnxMLP(nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 5)).astype(jnp.float16)
    y = jnp.ones((4, 2))
    opt = lsj.LossScaleOptimizer(
        model, lsj.loss_scaling(optax.sgd(0.1), lsj.HeadroomScale()), wrt=nnx.Param
    )

    def loss_fn(model, sinks, opt):  # the optimizer the step receives: its scale is traced
        with lsj.taps.recording(sinks, model=model):
            out = model(x)
            loss = jnp.mean((out.astype(jnp.float32) - y) ** 2)
            return lsj.scale_loss(loss, opt.opt_state)

    sinks = lsj.taps.discover(loss_fn, model, None, opt)
    assert sinks.names == ("inp", "out", "NnxMLP", "loss")

    @nnx.jit
    def step(model, opt, sinks):
        grads, taps = nnx.grad(loss_fn, argnums=(0, 1))(model, sinks, opt)
        opt.update(model, grads, taps=taps)
        return taps

    scale = float(lsj.get_loss_scale_state(nnx.as_pure(opt.opt_state)).scale)
    taps = step(model, opt, sinks)
    # the reference: the same network, split at the boundaries
    h_in = model.inp(x)  # the weights before the step are gone; recompute from a copy below
    del h_in
    assert float(taps.max_abs()["loss"]) == scale  # the loss's cotangent is the scale
    assert float(taps.uses()["inp"]) == 1.0
    # HeadroomScale read the taps: its peak holds at least the loss's range
    peak = float(lsj.get_loss_scale_state(nnx.as_pure(opt.opt_state)).range_peak)
    assert peak >= 1.0 / float(np.finfo(np.float16).max)


def test_a_tap_that_overflows_skips_the_step():
    # A float16 loss at scale 2**16: its cotangent (the scale) overflows float16.
    params = {"w": jnp.ones((3,), jnp.float32)}
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.StaticScale(2.0**16))
    opt_state = tx.init(params)

    def loss_fn(p):
        return lsj.scale_loss(jnp.sum(p["w"]).astype(jnp.float16), opt_state)

    _, _, taps = lsj.taps.value_and_grad(loss_fn)(params)
    assert bool(taps.overflow()) and float(taps.nonfinite()["loss"]) == 1.0
    # Finite gradients beside it (as when the inf meets a zero on its way to the
    # parameters): the tap alone decides, on both paths.
    grads = {"w": jnp.full((3,), 2.0)}
    new, state = lsj.apply_gradients(tx, grads, opt_state, params, taps=taps)
    assert bool(lsj.get_loss_scale_state(state).last_skipped)
    assert_bits_equal(new, params, "skipped")
    updates, state = tx.update(grads, opt_state, params, taps=taps)
    assert bool(lsj.get_loss_scale_state(state).last_skipped)
    assert_bits_equal(optax.apply_updates(params, updates), params, "skipped")
    _, state = lsj.apply_gradients(tx, grads, opt_state, params)  # without the taps: applied
    assert not bool(lsj.get_loss_scale_state(state).last_skipped)


@FLOAT16_PARAMS
def test_headroom_target_from_the_loss_tap_matches_the_rule():
    from reference_scalers import ReferenceHeadroom

    policy = lsj.HeadroomScale(init_scale=2.0**10)
    params = {"w": jnp.full((4,), 0.5, jnp.float16)}
    tx = lsj.loss_scaling(optax.sgd(1e-3), policy)
    opt_state = tx.init(params)
    ref = ReferenceHeadroom(policy)

    @jax.jit
    def step(params, opt_state):
        def loss_fn(p):
            return lsj.scale_loss(jnp.sum(p["w"] * p["w"]) * jnp.float16(1e-4), opt_state)

        _, grads, taps = lsj.taps.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params, taps=taps)
        return optax.apply_updates(params, updates), opt_state, grads, taps

    for _ in range(5):
        scale = float(lsj.get_loss_scale_state(opt_state).scale)
        params, opt_state, grads, taps = step(params, opt_state)
        g = np.abs(np.asarray(grads["w"], np.float32))
        overflow = not np.all(np.isfinite(g)) or bool(taps.overflow())
        amax = max(g.max(), float(taps.max_abs()["loss"])) / (scale * 65504.0)
        ref.step(overflow, np.float32(amax))
        assert float(lsj.get_loss_scale_state(opt_state).scale) == ref.scale
    assert ref.scale == 2.0**14  # the loss's cotangent caps it: room 2**15, one octave margin


@pytest.mark.multidevice
def test_reduced_in_the_flag_collective_under_pmap():
    params = {"w": jnp.ones((3,), jnp.float32)}
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.HeadroomScale(), axis_name="b")
    opt_state = tx.init(params)
    # device 2's loss is 1e4 times larger: its loss tap range sets everyone's scale
    weights = jnp.asarray([1.0, 1.0, 1e4, 1.0], jnp.float16)

    def step(params, opt_state, wt, use_taps):
        def loss_fn(p):
            return lsj.scale_loss(jnp.sum(p["w"]).astype(jnp.float16) * wt, opt_state)

        _, grads, taps = lsj.taps.value_and_grad(loss_fn)(params)
        extra = {"taps": taps} if use_taps else {}
        return tx.update(grads, opt_state, params, **extra)[1]

    def lowered(use_taps):
        f = jax.pmap(lambda w: step(params, opt_state, w, use_taps), axis_name="b")
        return f, all_reduces(f.lower(weights).compile().as_text())

    f, with_taps = lowered(True)
    _, without = lowered(False)
    assert with_taps == without == ["f32[3]"]  # [flag, amax, one leaf's flag]: one all-reduce
    scales = np.asarray(lsj.get_loss_scale_state(f(weights)).scale)
    assert np.all(scales == scales[0])


def test_accumulation_and_train_state_read_taps():
    params = {"w": jnp.ones((2,), jnp.float32)}
    tx = lsj.loss_scaling_multi_steps(optax.sgd(0.1), lsj.StaticScale(2.0**16), every_k=2)
    opt_state = tx.init(params)

    def loss_fn(p):
        return lsj.scale_loss(jnp.sum(p["w"]).astype(jnp.float16), opt_state)

    _, grads, taps = lsj.taps.value_and_grad(loss_fn)(params)
    _, opt_state = tx.update(grads, opt_state, params, taps=taps)
    assert bool(opt_state.window_overflow)  # the micro-batch's tap overflow is folded in

    state = lsj.TrainState.create(
        apply_fn=None, params=params, tx=lsj.loss_scaling(optax.sgd(0.1), lsj.StaticScale(2.0**16))
    )

    def loss2(p):
        return lsj.scale_loss(jnp.sum(p["w"]).astype(jnp.float16), state.opt_state)

    _, grads, taps = lsj.taps.value_and_grad(loss2)(params)
    new = state.apply_gradients(grads=grads, taps=taps)
    assert int(new.step) == 0 and bool(lsj.get_loss_scale_state(new.opt_state).last_skipped)


def test_taps_used_wrongly():
    with pytest.raises(lsj.errors.TapError, match="non-empty"):
        lsj.tap(jnp.ones(2), "")
    with pytest.raises(TypeError, match="tap name must be a str"):
        lsj.tap(jnp.ones(2), 3)
    with pytest.raises(TypeError, match="only a floating array"):
        lsj.taps.value_and_grad(lambda w: w * lsj.tap(jnp.arange(3), "i").sum())(1.0)
    # sinks from another function: the tap is named
    sinks = lsj.taps.discover(lambda w: lsj.tap(w, "a"), 1.0)

    def other(sinks, w):
        with lsj.taps.recording(sinks):
            return lsj.tap(w, "b")

    with pytest.raises(lsj.errors.TapError, match="'b' was not there"):
        jax.grad(other)(sinks, 1.0)
    with pytest.raises(lsj.errors.TapError, match="recording needs the sinks"):
        with lsj.taps.recording({"a": jnp.zeros(3)}):  # type: ignore[arg-type]
            pass
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale())
    st = tx.init({"w": jnp.ones(2)})
    with pytest.raises(lsj.errors.TapError, match="taps must be the TapStats"):
        tx.update({"w": jnp.ones(2)}, st, taps={"loss": jnp.zeros(3)})
    stacked = jax.tree_util.tree_map(lambda v: jnp.stack([v, v]), sinks)
    with pytest.raises(lsj.errors.TapError, match="each device's own statistics"):
        tx.update({"w": jnp.ones(2)}, st, taps=stacked)
    with pytest.raises(ValueError, match="argnums"):
        lsj.taps.value_and_grad(lambda w: w, argnums=-1)


def test_vmap_per_example_taps_fold_into_one_pass():
    # Per-example gradients: vmap of the tapped gradient gives one vector per example;
    # folded, the counts are the examples' sums and max_abs the largest of theirs (exactly:
    # the fold reads the vmapped program's own vectors). Each example's vector is that of the
    # example computed on its own without vmap, up to float16 rounding placed differently in
    # the two programs (XLA:GPU fuses them apart: 794.5 against 794.4375 was seen there).
    p = make_params()
    xs = jax.random.normal(jax.random.PRNGKey(5), (6, 1, 6)).astype(jnp.float16)
    xs = xs * jnp.asarray([1, 2, 4, 8, 16, 32], jnp.float16)[:, None, None]
    ys = jnp.zeros((6, 1, 3))
    scale = 2.0**6
    _, grads, taps = jax.vmap(TAPPED_GRAD, (None, 0, None))(p, (xs, ys), scale)
    singles = [TAPPED_GRAD(p, (xs[i], ys[i]), scale)[2] for i in range(6)]
    folded = taps.fold()
    rel = GRAD_ROUNDINGS * F16_UNIT_ROUNDOFF
    for name in folded.names:
        rows = np.asarray(taps.values[taps.names.index(name)])  # one vector per example
        got = {k: float(v) for k, v in folded.summary()[name].items()}
        assert got["uses"] == 6.0
        assert got["max_abs"] == float(rows[:, layout.MAX].max())
        assert got["nonfinite"] == float(rows[:, layout.NONFINITE].sum())
        np.testing.assert_array_equal(
            np.asarray(folded.values[folded.names.index(name)])[layout.NONZERO],
            rows[:, layout.NONZERO].sum(),
        )
        for i, single in enumerate(singles):
            alone = np.asarray(single.values[single.names.index(name)])
            np.testing.assert_allclose(rows[i, layout.MAX], alone[layout.MAX], rtol=rel)
            assert rows[i, layout.NONFINITE] == alone[layout.NONFINITE] == 0.0
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.HeadroomScale(init_scale=scale))
    batch_grads = jax.tree_util.tree_map(lambda g: jnp.sum(g, axis=0), grads)
    with pytest.raises(lsj.errors.TapError, match=r"taps\.fold\(axis=0\)"):
        tx.update(batch_grads, tx.init(p), p, taps=taps)
    _, state = tx.update(batch_grads, tx.init(p), p, taps=folded)
    assert not bool(state.loss_scale.last_skipped)
    with pytest.raises(ValueError, match="fold needs a batch"):
        singles[0].fold()
