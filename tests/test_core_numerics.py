"""Overflow detection and unscaling, against values derived by hand and NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lossscale_jax as lsj
from lossscale_jax import numerics

F16_MAX = 65504.0


def tree(*values, dtype=jnp.float16):
    return {"a": jnp.asarray(values[:1], dtype), "b": [jnp.asarray(values[1:], dtype)]}


@pytest.mark.parametrize(
    "value, ieee, saturating, both",
    [
        (1.0, False, False, False),
        (65504.0, False, True, True),
        (-65504.0, False, True, True),
        (65472.0, False, False, False),  # the float16 value just below the maximum
        (np.inf, True, True, True),
        (-np.inf, True, True, True),
        (np.nan, True, False, True),
    ],
)
def test_modes_on_float16(value, ieee, saturating, both):
    g = tree(0.5, 2.0, value)
    assert bool(lsj.check_overflow(g, "ieee")) is ieee
    assert bool(lsj.check_overflow(g, "saturating")) is saturating
    assert bool(lsj.check_overflow(g, "both")) is both


def test_saturating_threshold_comes_from_compute_dtype_for_float32_grads():
    # fp32 master weights cast to fp16 inside the loss: fp32 gradients, fp16 threshold.
    g = {"w": jnp.array([1.0, 65504.0], jnp.float32)}
    assert bool(lsj.check_overflow(g, "saturating"))
    assert not bool(lsj.check_overflow({"w": jnp.array([65503.0], jnp.float32)}, "saturating"))
    assert not bool(lsj.check_overflow(g, "saturating", compute_dtype=jnp.float32))
    assert not bool(lsj.check_overflow(g, "ieee"))


def test_non_float_leaves_are_not_checked_nor_unscaled_none_is_ignored():
    g = {
        "w": jnp.ones(2, jnp.float16),
        "n": None,
        "i": jnp.array([2**30], jnp.int32),
        "m": jnp.array([True]),
    }
    # An integer cannot overflow: the check reads it as finite ...
    assert not bool(lsj.check_overflow(g, "both"))
    assert not bool(lsj.check_overflow({}, "both"))
    # ... but it cannot be unscaled either: refused, naming the leaf.
    with pytest.raises(lsj.errors.GradientDtypeError, match=r"unscale: .*\['i'\] is int32"):
        lsj.unscale_and_check(g, 4.0)
    out, flag = lsj.unscale_and_check({"w": g["w"], "n": None}, 4.0)
    assert out["n"] is None and not bool(flag)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_unscale_without_params(dtype):
    g = {"w": jnp.array([3.0, -8.0], dtype)}
    out = lsj.unscale(g, 4.0)["w"]
    want = jnp.float32 if dtype == jnp.float16 else dtype
    assert out.dtype == want
    np.testing.assert_array_equal(np.asarray(out, np.float32), [0.75, -2.0])


@pytest.mark.parametrize("pdtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_unscale_takes_param_dtype(pdtype):
    g = {"w": jnp.array([3.0], jnp.float16)}
    out = lsj.unscale(g, 2.0, params={"w": jnp.zeros(1, pdtype)})["w"]
    assert out.dtype == pdtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), [1.5])


def test_unscale_in_float32_keeps_what_float16_would_lose():
    # 1.0 * 2**-10 / 2**20 = 2**-30: representable in float32, 0 in float16.
    scale = 2.0**20
    g = {"w": jnp.array([2.0**-10], jnp.float16)}
    out = lsj.unscale(g, scale, params={"w": jnp.zeros(1, jnp.float32)})["w"]
    assert float(out[0]) == 2.0**-30
    # What unscaling in float16 gives (2**20 itself overflows float16, so divide
    # by 2**10 twice): 2**-20 is a float16 subnormal, 2**-30 underflows to 0.
    half = jnp.float16(2.0**10)
    assert float((g["w"] / half)[0]) == 2.0**-20
    assert float((g["w"] / half / half)[0]) == 0.0


@pytest.mark.parametrize("mode", ["ieee", "saturating", "both"])
def test_unscale_and_check_equals_the_two_separate_functions(mode):
    rng = np.random.default_rng(0)
    g = {
        "a": jnp.asarray(rng.normal(size=(5, 3)) * 100, jnp.float16),
        "b": jnp.asarray(rng.normal(size=7), jnp.float32).at[3].set(F16_MAX),
        "c": jnp.asarray(rng.normal(size=4), jnp.bfloat16),
    }
    params = {"a": jnp.zeros((5, 3)), "b": jnp.zeros(7), "c": jnp.zeros(4, jnp.bfloat16)}
    with jax.numpy_dtype_promotion("strict"):
        out, flag = jax.jit(lambda g, p: lsj.unscale_and_check(g, 64.0, params=p, mode=mode))(
            g, params
        )
        ref = lsj.unscale(g, 64.0, params)
    assert bool(flag) == bool(lsj.check_overflow(g, mode)) == (mode != "ieee")
    for k in g:
        assert out[k].dtype == params[k].dtype
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(ref[k]))
        expected = np.asarray(g[k], np.float32) / np.float32(64.0)
        np.testing.assert_array_equal(
            np.asarray(out[k], np.float32), expected.astype(params[k].dtype).astype(np.float32)
        )


@pytest.mark.parametrize("bad", ["inf", "IEEE", None, 3])
def test_bad_mode(bad):
    with pytest.raises(ValueError, match="overflow must be one of"):
        lsj.check_overflow({}, bad)


def test_bad_compute_dtype():
    with pytest.raises(TypeError, match="compute_dtype"):
        lsj.check_overflow({}, "ieee", compute_dtype=jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float64, float, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_compute_dtype_outside_float16_bfloat16_float32_is_refused(dtype):
    # float64: no float16/bfloat16/float32 gradient reaches its max, so "saturating" never
    # fires; float8: finfo(float16).max = 65504 is not representable.
    with pytest.raises(ValueError, match=r"compute_dtype must be one of \('float16'"):
        lsj.check_overflow({}, "saturating", compute_dtype=dtype)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_compute_dtypes_allowed(dtype):
    g = {"w": jnp.array([float(jnp.finfo(dtype).max)], jnp.float32)}
    assert bool(lsj.check_overflow(g, "saturating", compute_dtype=dtype))


@pytest.mark.parametrize(
    "scale", [0, 0.0, -1.0, np.float64(-2.0), float("nan"), float("inf"), 1e-50]
)
def test_unscale_refuses_a_host_scale_that_is_not_finite_and_positive(scale):
    g = {"w": jnp.array([2.0, 4.0], jnp.float16)}
    for fn in (lambda: lsj.unscale(g, scale), lambda: lsj.unscale_and_check(g, scale)):
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            fn()


def test_unscale_refuses_a_non_scalar_scale():
    with pytest.raises(ValueError, match=r"scale must be a scalar, got shape \(2,\)"):
        lsj.unscale({"w": jnp.ones(2)}, np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"scale must be a scalar, got shape \(2,\)"):
        lsj.unscale_and_check({"w": jnp.ones(2)}, jnp.array([1.0, 2.0]))


@pytest.mark.parametrize("scale", [0.0, -4.0, np.nan, np.inf])
def test_a_bad_device_scale_is_an_overflow_with_nan_gradients(scale):
    """On the device the scale is not read back: the step is flagged (skipped in every mode)
    and the unscaled gradients are nan, never inf, zero or sign-flipped."""
    g = {"w": jnp.array([2.0, -4.0], jnp.float16)}
    for mode in ("ieee", "saturating", "both"):
        out, overflow = jax.jit(lambda g, s, mode=mode: lsj.unscale_and_check(g, s, mode=mode))(
            g, jnp.float32(scale)
        )
        assert bool(overflow) and bool(jnp.all(jnp.isnan(out["w"])))
    assert bool(jnp.all(jnp.isnan(jax.jit(lsj.unscale)(g, jnp.float32(scale))["w"])))
    # A good scale: exactly the division, and no flag.
    out, overflow = jax.jit(lsj.unscale_and_check)(g, jnp.float32(4.0))
    assert not bool(overflow) and np.asarray(out["w"]).tolist() == [0.5, -1.0]


# --------------------------------------------------------------------------
# Probes: every bit pattern, and special values at random positions of real
# leaves. The reference is the rule in NumPy (comparison in the leaf's dtype,
# the threshold rounded to it), never the code under test.

MODES = ("ieee", "saturating", "both")
LEAF_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)


def reference(values: np.ndarray, mode: str, compute_dtype) -> np.ndarray:
    """The overflow rule, elementwise, in NumPy."""
    with np.errstate(over="ignore", invalid="ignore"):
        limit = np.asarray(float(jnp.finfo(compute_dtype).max)).astype(values.dtype)
        v = values.astype(np.float64)
    limit = limit.astype(np.float64)
    nonfinite = ~np.isfinite(v)
    with np.errstate(invalid="ignore"):
        saturated = np.abs(v) >= limit  # nan compares False
    return {"ieee": nonfinite, "saturating": saturated, "both": nonfinite | saturated}[mode]


def bit_patterns(dtype) -> np.ndarray:
    """Every 16-bit pattern; for float32 the specials, the neighbours of the thresholds
    and 2**16 random patterns."""
    if np.dtype(dtype).itemsize == 2:
        return np.arange(2**16, dtype=np.uint16).view(np.dtype(dtype))
    rng = np.random.default_rng(0)
    f32 = np.float32
    edges = [np.inf, np.nan, 65504.0, float(np.finfo(f32).max), float(jnp.finfo(jnp.bfloat16).max)]
    near = [np.nextafter(f32(e), f32(0)) for e in edges[2:]] + [
        np.nextafter(f32(65504), f32(np.inf))
    ]
    special = np.array(edges + near + [0.0, 1.0, 2.0**-149], f32)
    special = np.concatenate([special, -special])
    nan_payloads = np.array([0x7F800001, 0x7FFFFFFF, 0xFFC00000, 0xFF800001], np.uint32).view(f32)
    random = rng.integers(0, 2**32, size=2**16, dtype=np.uint64).astype(np.uint32).view(f32)
    return np.concatenate([special, nan_payloads, random])


@pytest.mark.parametrize("compute_dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("dtype", LEAF_DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_bit_pattern_in_every_mode(dtype, compute_dtype):
    """Each pattern sits alone among benign values in a row of a leaf; the rows are
    checked by the same grouped reduction (vmapped), leaf flags and total alike."""
    values = bit_patterns(dtype)
    n, width = values.size, 8
    rng = np.random.default_rng(1)
    rows = np.asarray(rng.normal(size=(n, width)), np.float32).astype(np.dtype(dtype))
    rows[np.arange(n), rng.integers(0, width, n)] = values
    benign = jnp.asarray(rng.normal(size=(n, width)), dtype)
    odd = jnp.ones((n, 3), dtype)  # a leaf of another shape: a group of its own

    @jax.jit
    def run(rows, benign, odd):  # arguments, not constants: XLA would fold the check
        def one(r, b, o):
            tree = {"a": b, "p": r, "q": o}
            return tuple(
                (
                    lsj.check_overflow(tree, m, compute_dtype),
                    numerics.overflow_flags(tree, m, compute_dtype),
                )
                for m in MODES
            )

        return jax.vmap(one)(rows, benign, odd)

    out = run(jnp.asarray(rows), benign, odd)
    for mode, (total, flags) in zip(MODES, out, strict=True):
        want = reference(values, mode, compute_dtype)
        np.testing.assert_array_equal(np.asarray(total), want, err_msg=mode)
        np.testing.assert_array_equal(np.asarray(flags["p"]), want, err_msg=mode)
        assert not np.asarray(flags["a"]).any() and not np.asarray(flags["q"]).any()
    # The probe holds what it must: inf, -inf, nan, +-65504 (where the dtype has them).
    with np.errstate(invalid="ignore"):
        v = values.astype(np.float64)
    assert np.isposinf(v).any() and np.isneginf(v).any() and np.isnan(v).any()


# Leaves of assorted shapes (same-shape groups, a scalar, odd sizes, > 32 in every dim).
PROBE_SHAPES = {
    "w1": ((300, 70), jnp.float16),
    "w2": ((300, 70), jnp.float16),
    "w3": ((300, 70), jnp.float16),
    "b": ((70,), jnp.float16),
    "v": ((4097,), jnp.bfloat16),
    "s": ((), jnp.float32),
    "t": ((3, 5, 7), jnp.float32),
    "m": ((65, 33, 40), jnp.bfloat16),
}


def probe_values(dtype, compute_dtype) -> list[float]:
    big = float(jnp.finfo(compute_dtype).max)
    return [np.inf, -np.inf, np.nan, -np.nan, 65504.0, -65504.0, big, -big, 65472.0, -3.0]


@pytest.mark.parametrize("compute_dtype", [jnp.float16, jnp.bfloat16])
def test_special_values_at_random_positions(compute_dtype):
    """The compiled (not vmapped) check, one special value at a time, at the first, the
    last and random positions of each leaf; leaf flags name the leaf that holds it."""
    rng = np.random.default_rng(2)
    base = {
        k: np.asarray(rng.normal(size=s) * 100.0, np.float32).astype(np.dtype(d))
        for k, (s, d) in PROBE_SHAPES.items()
    }

    @jax.jit
    def run(tree):
        return tuple(
            (
                lsj.check_overflow(tree, m, compute_dtype),
                numerics.overflow_flags(tree, m, compute_dtype),
            )
            for m in MODES
        )

    clean = run(base)
    assert not any(bool(t) for t, _ in clean)
    probes = 0
    for name, (shape, dtype) in PROBE_SHAPES.items():
        size = int(np.prod(shape))
        positions = {0, size - 1, *rng.integers(0, size, 2).tolist()}
        for value in probe_values(dtype, compute_dtype):
            with np.errstate(over="ignore"):  # float32's max is inf in float16
                stored = np.asarray(value, np.float32).astype(np.dtype(dtype))
            for pos in positions:
                tree = {k: v.copy() for k, v in base.items()}
                tree[name].reshape(-1)[pos] = stored
                out = run(tree)
                for mode, (total, flags) in zip(MODES, out, strict=True):
                    want = bool(reference(np.asarray([stored]), mode, compute_dtype)[0])
                    assert bool(total) is want, (name, value, pos, mode)
                    assert {k for k, f in flags.items() if bool(f)} == ({name} if want else set())
                probes += 1
    assert probes >= 200


def test_overflow_flags_keep_the_tree():
    g = {
        "a": jnp.array([1.0, np.nan], jnp.float16),
        "b": [jnp.array([65504.0], jnp.float32), None],
        "i": jnp.array([2**30], jnp.int32),
    }
    flags = numerics.overflow_flags(g, "both")
    assert jax.tree_util.tree_structure(flags) == jax.tree_util.tree_structure(g)
    assert [bool(f) for f in jax.tree_util.tree_leaves(flags)] == [True, True, False]
    assert all(f.dtype == jnp.bool_ and f.shape == () for f in jax.tree_util.tree_leaves(flags))
    sat = numerics.overflow_flags(g, "saturating")
    assert (bool(sat["a"]), bool(sat["b"][0])) == (False, True)  # nan is not a saturation
