"""lossscale_jax.testing.saturating: an emulated saturating float16 device, and what it shows.

References: NumPy's float16 arithmetic and the host's (IEEE) JAX results, clamped by a rule
written here in NumPy (nan -> 0, +-inf and beyond -> +-65504); hand-derived values; and, end to
end, the same training on IEEE hardware.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import F16_UNIT_ROUNDOFF, load_script  # tests/ is on sys.path under pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import lossscale_jax as lsj
from lossscale_jax.testing import saturate, saturating

F16 = np.float16
MAX16 = float(np.finfo(np.float16).max)  # 65504


def clamp_ref(x, dtype=np.float16):
    """The device's rule, in NumPy: nan -> 0, values beyond +-max -> +-max."""
    x = np.asarray(x, dtype)
    big = np.finfo(dtype).max
    return np.where(np.isnan(x), dtype(0), np.clip(x, -big, big)).astype(dtype)


def assert_same(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    np.testing.assert_array_equal(actual, expected)


# Every float16 bit pattern: the whole range, subnormals, inf and nan included.
f16_values = st.integers(0, 2**16 - 1).map(lambda b: np.array(b, np.uint16).view(np.float16))
big_f16 = st.floats(min_value=-3e4, max_value=3e4, width=16)


def f16_arrays(shape, elements=f16_values):
    size = int(np.prod(shape))
    values = st.lists(elements, min_size=size, max_size=size)
    return values.map(lambda v: np.array(v, np.float16).reshape(shape))


# --------------------------------------------------------------------------
# The clamp rule itself.


def test_saturate_rule():
    x = jnp.array([np.inf, -np.inf, np.nan, 65504.0, -65504.0, 1.5, 0.0], jnp.float16)
    expected = np.array([65504.0, -65504.0, 0.0, 65504.0, -65504.0, 1.5, 0.0], F16)
    assert_same(saturate(x), expected)
    # Leaves of other dtypes are untouched; float32 is never clamped at 65504.
    tree = {"a": x, "b": jnp.array([1e6, np.inf], jnp.float32), "c": jnp.arange(3)}
    out = saturate(tree)
    assert_same(out["b"], np.array([1e6, np.inf], np.float32))
    assert_same(out["c"], np.arange(3, dtype=np.int32))
    # Another saturating dtype uses its own max.
    bf = saturate(jnp.array([np.inf, np.nan], jnp.bfloat16), jnp.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(bf, np.float32), [float(jnp.finfo(jnp.bfloat16).max), 0]
    )


# --------------------------------------------------------------------------
# Single primitives: the saturated result is the IEEE result clamped.

_add = jax.jit(saturating(lambda a, b: a + b))
_mul = jax.jit(saturating(lambda a, b: a * b))
_exp = jax.jit(saturating(jnp.exp))


@settings(max_examples=30)
@given(f16_arrays((16,)), f16_arrays((16,)))
def test_elementwise_add_mul_match_numpy_then_clamp(a, b):
    with np.errstate(all="ignore"):
        assert_same(_add(a, b), clamp_ref(a + b))  # NumPy float16 arithmetic
        assert_same(_mul(a, b), clamp_ref(a * b))


@settings(max_examples=30)
@given(f16_arrays((16,), st.floats(min_value=-30, max_value=30, width=16)))
def test_exp_matches_ieee_then_clamp(x):
    ieee = np.asarray(jnp.exp(jnp.asarray(x)))  # exp(x) > 65504 for x > 11.09
    assert_same(_exp(x), clamp_ref(ieee))
    with np.errstate(over="ignore"):
        np.testing.assert_allclose(_exp(x).astype(np.float32), clamp_ref(np.exp(x)), rtol=2e-3)


_reductions = {
    "sum": jax.jit(saturating(lambda x: jnp.sum(x, axis=1))),
    "max": jax.jit(saturating(lambda x: jnp.max(x, axis=1))),
    "prod": jax.jit(saturating(lambda x: jnp.prod(x, axis=1))),
    "cumsum": jax.jit(saturating(lambda x: jnp.cumsum(x, axis=1))),
}


@settings(max_examples=20)
@given(f16_arrays((4, 8), big_f16))
def test_reductions_match_ieee_then_clamp(x):
    for name, fn in _reductions.items():
        ieee = {"sum": jnp.sum, "max": jnp.max, "prod": jnp.prod, "cumsum": jnp.cumsum}[name]
        assert_same(fn(x), clamp_ref(ieee(jnp.asarray(x), axis=1)))


_dot = jax.jit(saturating(jnp.dot))


def _conv(x, w):
    return lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


_conv_sat = jax.jit(saturating(_conv))


@settings(max_examples=15)
@given(f16_arrays((4, 8), big_f16), f16_arrays((8, 3), st.floats(-30, 30, width=16)))
def test_dot_matches_ieee_then_clamp(a, b):
    assert_same(_dot(a, b), clamp_ref(jnp.dot(jnp.asarray(a), jnp.asarray(b))))


@settings(max_examples=10)
@given(f16_arrays((1, 5, 5, 2), big_f16), f16_arrays((3, 3, 2, 2), st.floats(-30, 30, width=16)))
def test_convolution_matches_ieee_then_clamp(x, w):
    assert_same(_conv_sat(x, w), clamp_ref(_conv(jnp.asarray(x), jnp.asarray(w))))


def test_overflowing_primitives_saturate():
    """Hand-derived: each of these overflows float16 and comes back as +-65504 or 0."""
    x = jnp.array([300.0, -300.0], jnp.float16)
    assert_same(saturating(lambda a: a * a * jnp.sign(a))(x), np.array([MAX16, -MAX16], F16))
    assert_same(saturating(jnp.exp)(jnp.array([12.0], jnp.float16)), np.array([MAX16], F16))
    inf = jnp.array([np.inf], jnp.float16)
    assert_same(saturating(lambda a: a - a)(inf), np.array([0.0], F16))  # nan -> 0
    m = jnp.full((2, 300), 300.0, jnp.float16)
    assert_same(saturating(lambda a: a @ a.T)(m), np.full((2, 2), MAX16, F16))


def test_other_dtypes_are_not_clamped():
    x32 = jnp.array([1e5], jnp.float32)
    assert_same(saturating(lambda a: a * 2.0)(x32), np.array([2e5], np.float32))
    # A float16 dot accumulating into float32 is a float32 result: not clamped.
    a = jnp.full((1, 4), 300.0, jnp.float16)
    f = saturating(lambda u: jnp.dot(u, u.T, preferred_element_type=jnp.float32))
    assert_same(f(a), np.array([[360000.0]], np.float32))
    # With dtype=float32 the float16 results are left alone and float32 ones clamp.
    g = saturating(lambda u, v: (u * 1000.0, v * 1e38), dtype=jnp.float32)
    u, v = g(jnp.array([100.0], jnp.float16), jnp.array([10.0], jnp.float32))
    assert_same(u, np.array([np.inf], F16))
    assert_same(v, np.array([np.finfo(np.float32).max], np.float32))


# --------------------------------------------------------------------------
# Chains of primitives and higher-order primitives: every intermediate saturates.


def chain(x):
    """Overflows in the middle: IEEE gives inf and nan, a saturating device 65.5 and 0."""
    y = x * 1000.0
    return y / 1000.0, y - y


def chain_ref(x):
    """NumPy reference model: clamp after every float16 operation."""
    with np.errstate(over="ignore", invalid="ignore"):
        y = clamp_ref(np.asarray(x, F16) * F16(1000.0))
    return clamp_ref(y / F16(1000.0)), clamp_ref(y - y)


X = jnp.array([100.0, -100.0, 1.0, 0.5], jnp.float16)


def test_chain_overflows_in_ieee():
    # Op by op (not under jit, where XLA:CPU may keep the intermediate in float32).
    a, b = chain(X)
    assert np.isinf(np.asarray(a[0])) and np.isnan(np.asarray(b[0]))


@jax.custom_jvp
def chain_custom_jvp(x):
    return chain(x)


chain_custom_jvp.defjvp(lambda primals, tangents: (chain(*primals), chain(*tangents)))


@jax.custom_vjp
def chain_custom_vjp(x):
    return chain(x)


chain_custom_vjp.defvjp(lambda x: (chain(x), None), lambda _, g: (g[0],))


def _scan(x):
    def body(carry, _):
        return carry, chain(carry)

    _, (a, b) = lax.scan(body, x, None, length=2)
    return a[-1], b[-1]


def _while(x):
    # A traced trip count makes this a while loop; its body overflows each time.
    n = jnp.int32(x.shape[0] - 2) * (x[0] > 0).astype(jnp.int32)
    return lax.fori_loop(0, n, lambda i, c: (chain(c[0] * 1000.0)[0], c[1]), chain(x))


HIGHER_ORDER = {
    "jit": jax.jit(chain),
    "checkpoint": jax.checkpoint(chain),
    "custom_jvp": chain_custom_jvp,
    "custom_vjp": chain_custom_vjp,
    "cond": lambda x: lax.cond(x[0] > 0, chain, lambda a: (a, a), x),
    "scan": _scan,
    "while": _while,
    "nested": jax.jit(lambda x: lax.cond(x[0] > 0, jax.checkpoint(chain), lambda a: (a, a), x)),
}


@pytest.mark.parametrize("name", sorted(HIGHER_ORDER))
def test_higher_order_primitives_saturate_inside(name):
    fn = HIGHER_ORDER[name]
    expected = chain_ref(X)
    if name == "while":  # two more trips of (c * 1000) * 1000 / 1000, clamped each time
        c = expected[0]
        for _ in range(2):
            c = chain_ref(clamp_ref(c * F16(1000.0)))[0]
        expected = (c, expected[1])
    for out in (saturating(fn)(X), jax.jit(saturating(fn))(X)):
        assert_same(out[0], expected[0])
        assert_same(out[1], expected[1])


def test_weak_typed_loop_carry_keeps_its_type():
    # fori_loop(0, n, ..., 1.0) carries a weak-typed float32; the rewritten body must too.
    f = saturating(lambda n: lax.fori_loop(0, n, lambda i, c: c * 1e30, 1.0), jnp.float32)
    assert_same(jax.jit(f)(jnp.int32(3)), np.float32(np.finfo(np.float32).max))


@pytest.mark.multidevice
def test_inside_shard_map_body():
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))

    def body(x):  # scan and cond bodies see values that vary over "b"
        return saturating(HIGHER_ORDER["scan"])(x)[0], saturating(HIGHER_ORDER["cond"])(x)[1]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("b"), out_specs=(P("b"), P("b"))))
    x = jnp.tile(X, 8)
    a, b = f(x)
    assert_same(a, np.tile(chain_ref(X)[0], 8))
    assert_same(b, np.tile(chain_ref(X)[1], 8))  # every shard is X: the overflowing branch
    with pytest.raises(NotImplementedError, match="shard_map"):
        saturating(jax.shard_map(body, mesh=mesh, in_specs=P("b"), out_specs=(P("b"), P("b"))))(x)


def test_unhandled_higher_order_primitive_raises():
    def solve(b):
        return lax.custom_linear_solve(lambda x: 2.0 * x, b, lambda mv, y: y / 2.0)

    b = jnp.ones(3, jnp.float16)
    with pytest.raises(NotImplementedError, match="custom_linear_solve"):
        saturating(solve)(b)


# --------------------------------------------------------------------------
# Gradients, jit, pytrees and arguments.


def test_saturates_the_backward_pass():
    """d/dw sum(300 * (300 * w)) = 90000 per element: inf in IEEE, 65504 saturated."""

    def loss(w):
        return jnp.sum((w * 300.0).astype(jnp.float32) * 300.0)

    w = jnp.ones(3, jnp.float16)
    assert np.all(np.isinf(np.asarray(jax.grad(loss)(w))))
    g = jax.jit(saturating(jax.grad(loss)))(w)
    assert_same(g, np.full(3, MAX16, F16))
    assert not lsj.check_overflow(g, "ieee")
    assert lsj.check_overflow(g, "saturating")
    # The other order differentiates the clamps: 0 where the forward value saturated.
    f = saturating(lambda x: jnp.sum((x * 1000.0).astype(jnp.float32)))
    assert_same(jax.grad(f)(jnp.array([100.0, 1.0], jnp.float16)), np.array([0.0, 1000.0], F16))


def test_pytrees_kwargs_closures_and_one_trace():
    traces = []

    def fn(params, *, x):
        traces.append(None)
        return {"y": params["w"] * x, "n": params["n"] + 1}

    params = {"w": jnp.array([300.0], jnp.float16), "n": jnp.int32(1)}

    @jax.jit
    def step(params, x, s):
        out = saturating(fn)(params, x=x)
        closed = saturating(lambda v: v * s)(x)  # closes over a traced value
        return out, closed

    x = jnp.array([300.0], jnp.float16)
    for _ in range(2):
        out, closed = step(params, x, jnp.float16(1000.0))
    assert len(traces) == 1
    assert_same(out["y"], np.array([MAX16], F16))
    assert_same(out["n"], np.int32(2))
    assert_same(closed, np.array([MAX16], F16))
    # PRNG key arrays (extended dtypes) pass through.
    big = saturating(lambda k: (jnp.abs(jax.random.normal(k, (2,), jnp.float16)) + 1) * 1e3 * 1e3)
    assert_same(big(jax.random.key(0)), np.full(2, MAX16, F16))
    # Under vmap too.
    assert_same(jax.vmap(saturating(lambda v: v * v))(x), np.array([MAX16], F16))


def test_bad_arguments():
    with pytest.raises(TypeError, match="fn must be callable"):
        saturating(3)
    with pytest.raises(TypeError, match="dtype"):
        saturating(jnp.exp, dtype=jnp.int32)
    with pytest.raises(TypeError, match="dtype"):
        saturating(jnp.exp, dtype="not a dtype")
    with pytest.raises(TypeError, match="dtype"):
        saturate(jnp.ones(2), dtype=jnp.complex64)


def test_scaled_loss_cotangent_saturation_is_invisible_to_values():
    """The documented limit: a loss computed in float16 with a scale above 65504.

    The cotangent entering float16 is the scale itself; it saturates to 65504, and
    gradients of inputs below 1 in magnitude stay below 65504: no value check can see it.
    """
    x = jnp.array([0.5, -0.25], jnp.float16)
    state = lsj.DynamicScale(init_scale=2.0**17).init()

    def grad(w):
        return jax.grad(lambda w: lsj.scale_loss(jnp.sum(w * x), state))(w)

    w = jnp.ones(2, jnp.float16)
    assert lsj.check_overflow(grad(w), "ieee")  # IEEE: the cotangent is inf
    g = saturating(grad)(w)
    assert_same(g, np.array([MAX16 * 0.5, -MAX16 * 0.25], F16))  # computed with scale 65504
    assert not lsj.check_overflow(g, "both")


# --------------------------------------------------------------------------
# End to end: the example's training runs.


def _load_example():
    return load_script("examples/npu_saturation.py")


@pytest.fixture(scope="module")
def example():
    return _load_example()


@pytest.mark.slow
def test_ieee_check_misses_what_saturating_check_catches(example):
    """The same overflow (the initial scale of 2**24), seen by each check on each device."""
    (x, y), _ = example.make_data(1, 32)
    params = example.init_params()
    p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), params)
    state = example.make_tx("ieee").init(params)
    on_ieee = jax.jit(example.gradient_fn(False))(p16, state, x[0], y[0])
    on_npu = jax.jit(example.gradient_fn(True))(p16, state, x[0], y[0])
    assert lsj.check_overflow(on_ieee, "ieee")  # IEEE hardware: inf
    assert not lsj.check_overflow(on_npu, "ieee")  # saturated: no inf, no nan
    assert lsj.check_overflow(on_npu, "saturating")
    assert lsj.check_overflow(on_npu, "both")
    # The saturated gradients are the IEEE ones with inf clamped, where no nan arose.
    for g_ieee, g_npu in zip(jax.tree.leaves(on_ieee), jax.tree.leaves(on_npu), strict=True):
        g_ieee = np.asarray(g_ieee)
        assert np.all(np.abs(np.asarray(g_npu)) <= MAX16)
        finite = np.isfinite(g_ieee)
        assert_same(np.asarray(g_npu)[finite], g_ieee[finite])
        overflowed = np.isinf(g_ieee)
        assert_same(
            np.asarray(g_npu)[overflowed], np.copysign(MAX16, g_ieee[overflowed]).astype(F16)
        )


@pytest.mark.slow
def test_example_end_to_end(example, capsys):
    steps = 30
    results = example.main(steps=steps, batch=32)
    out = capsys.readouterr().out
    for label, _, _ in example.RUNS:
        assert label in out
    ref = results["IEEE device, ieee"]
    missed = results["saturating, ieee"]
    # IEEE hardware: the first steps overflow, are skipped, and the scale backs off.
    assert ref["skipped"][0] and ref["skipped"].sum() >= 5
    assert ref["scale"].min() <= example.INIT_SCALE / 2**5
    # Saturating device, ieee check: nothing is seen, the scale never backs off.
    assert not missed["skipped"].any()
    assert np.all(np.diff(missed["scale"]) >= 0) and missed["scale"][0] == example.INIT_SCALE
    # ... and training lags far behind (measured: about 4x the reference loss at 30 steps).
    assert missed["loss"][-1] > 2.0 * ref["loss"][-1]
    # Saturating device, saturating/both check: the reference's decisions, step for step.
    for label in ("saturating, saturating", "saturating, both"):
        run = results[label]
        np.testing.assert_array_equal(run["skipped"], ref["skipped"])
        np.testing.assert_array_equal(run["scale"], ref["scale"])
        # The losses agree to float16 rounding, not bit for bit: the saturating emulation
        # compiles the float16 backward into another program, which may keep an intermediate
        # in float32 where the reference rounds it (XLA:CPU with AVX-512 FP16 does; measured
        # there up to 6e-4 relative after 30 steps). Each good step's gradient entries then
        # differ by a few float16 roundings (2**-11 relative each); the parameters, and the
        # held-out loss with them, drift by as much again per step. 16 roundings (7.8e-3) is
        # that, and still far from the 2x the missed-overflow run is off above.
        np.testing.assert_allclose(run["loss"], ref["loss"], rtol=16 * F16_UNIT_ROUNDOFF)
