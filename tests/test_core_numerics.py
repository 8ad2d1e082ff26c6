"""Overflow detection and unscaling, against values derived by hand and NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lossscale_jax as lsj

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


def test_non_float_leaves_and_none_are_ignored():
    g = {
        "w": jnp.ones(2, jnp.float16),
        "n": None,
        "i": jnp.array([2**30], jnp.int32),
        "m": jnp.array([True]),
    }
    assert not bool(lsj.check_overflow(g, "both"))
    assert not bool(lsj.check_overflow({}, "both"))
    out, flag = lsj.unscale_and_check(g, 4.0)
    assert out["n"] is None and out["i"] is g["i"] and not bool(flag)


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
