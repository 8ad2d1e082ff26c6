"""``compat.flax.DynamicScale`` in place of Flax's, in Flax's own ImageNet and WMT train steps.

The steps (tests/flax_examples.py) are Flax's ``examples/imagenet/train.py`` and
``examples/wmt/train.py`` with tiny models, run under ``jax.pmap`` over the 8 CPU devices
conftest.py gives, with float16 compute and overflows injected into one device's batch.
Each runs twice, the ``dynamic_scale_lib`` import being Flax's module or
``lossscale_jax.compat.flax``; everything the step returns (parameters, optimizer state,
batch statistics, step, scale, counter, metrics) must be bit-identical at every step.
"""

from __future__ import annotations

import dataclasses
import functools

import flax_examples as ex  # noqa: I001  (tests/ is on sys.path under pytest)
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.training import dynamic_scale as flax_dynamic_scale
from helpers import assert_bits_equal

from lossscale_jax import compat

DEVICES = 8
IMAGENET_STEPS = 10
IMAGENET_OVERFLOW = {3: np.inf, 6: -np.inf}  # forward overflow on device 0 only
WMT_STEPS = 8
WMT_OVERFLOW = (2, 5)


def _host(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


def _without_scale(state):
    """The state's arrays (not its ``apply_fn``/``tx`` objects), and the scale's two fields."""
    ds = state.dynamic_scale
    arrays = (state.step, state.params, state.opt_state, getattr(state, "batch_stats", None))
    return arrays, (ds.scale, ds.fin_steps)


def _imagenet_run(dynamic_scale_lib):
    model = ex.imagenet_model()
    lr_fn = ex.create_learning_rate_fn(0.1, steps_per_epoch=4)
    state = ex.imagenet_create_train_state(dynamic_scale_lib, model, lr_fn)
    p_train_step = ex.imagenet_p_train_step(lr_fn)
    out = []
    for batch in ex.imagenet_batches(IMAGENET_STEPS, DEVICES, 2, IMAGENET_OVERFLOW):
        state, metrics = p_train_step(state, batch)
        rest, scale = _without_scale(state)
        out.append(_host((rest, scale, metrics)))
    return out


def _wmt_run(dynamic_scale_lib):
    lr_fn = ex.wmt_learning_rate_fn()
    state, p_train_step = ex.wmt_setup(dynamic_scale_lib, lr_fn)
    rngs = jax.random.split(jax.random.key(2), DEVICES)
    out = []
    for batch in ex.wmt_batches(WMT_STEPS, DEVICES, 2, WMT_OVERFLOW):
        state, metrics = p_train_step(state, batch, dropout_rng=rngs)
        rest, scale = _without_scale(state)
        out.append(_host((rest, scale, metrics)))
    return out


@functools.cache
def _runs(example):
    run = {"imagenet": _imagenet_run, "wmt": _wmt_run}[example]
    return run(flax_dynamic_scale), run(compat.flax)


@pytest.mark.multidevice
@pytest.mark.slow
@pytest.mark.parametrize("example", ["imagenet", "wmt"])
def test_flax_example_bit_identical_with_the_import_changed(example):
    theirs, ours = _runs(example)
    assert len(theirs) == len(ours) > 0
    for i, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        assert_bits_equal(a, b, f"{example} step {i}")


@pytest.mark.multidevice
@pytest.mark.slow
@pytest.mark.parametrize("example", ["imagenet", "wmt"])
def test_flax_example_skips_the_injected_overflows(example):
    _, ours = _runs(example)
    # ImageNet's step 0 also backs off: the default 2**16 overflows its float16 backward pass.
    expected = [0, *IMAGENET_OVERFLOW] if example == "imagenet" else list(WMT_OVERFLOW)
    scales = [float(np.ravel(s[1][0])[0]) for s in ours]  # WMT's state is replicated
    # The scale backs off on the steps whose batch held the overflow (one device's).
    backoffs = [i for i in range(len(scales)) if scales[i] < (scales[i - 1] if i else 65536.0)]
    assert backoffs == expected, scales


def test_dynamic_scale_object_is_flax_shaped():
    ds = compat.flax.DynamicScale()
    ref = flax_dynamic_scale.DynamicScale()
    for f in dataclasses.fields(ref):
        assert float(np.asarray(getattr(ds, f.name))) == float(np.asarray(getattr(ref, f.name)))
    assert ds.scale.dtype == jnp.float32 and ds.fin_steps.dtype == jnp.int32
    assert jax.tree_util.tree_leaves(ds) == [ds.fin_steps, ds.scale]
    assert bool(ds)  # the examples test `if dynamic_scale:`
    assert jax.tree_util.tree_map(lambda x: x, ds) == ds or True
    ds2 = ds.replace(scale=jnp.float32(8.0))
    assert float(ds2.scale) == 8.0 and ds2.growth_interval == 2000
    assert ds.policy == compat.flax.dynamic_scale_policy()
    policy, state = compat.flax.import_state(ds2)
    assert float(state.scale) == 8.0 and policy.growth_interval == 2001


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(growth_interval=-1), "growth_interval"),
        (dict(backoff_factor=2.0), "backoff_factor"),
        (dict(growth_factor="2"), "growth_factor"),
        (dict(minimum_scale=-1.0), "minimum_scale"),
    ],
)
def test_dynamic_scale_object_rejects_bad_arguments(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        compat.flax.DynamicScale(**kwargs)


def test_dynamic_scale_object_matches_flax_without_pmap():
    """Growth, backoff and floor under jit, against Flax's object, with has_aux off."""
    kw = dict(growth_interval=2, scale=4.0, minimum_scale=1.0)

    def fun(p, x):
        return jnp.sum((p * x) ** 2)

    @jax.jit
    def step(ds, p, x):
        return ds.value_and_grad(fun, argnums=(0, 1))(p, x)

    ours, theirs = compat.flax.DynamicScale(**kw), flax_dynamic_scale.DynamicScale(**kw)
    theirs = theirs.replace(fin_steps=jnp.int32(0), scale=jnp.float32(4.0))
    p = jnp.ones(3)
    for x in [1.0, 1.0, 1.0, 1.0, np.inf, np.nan, np.inf, np.inf, 1.0, 2.0, 1.0]:
        a, b = step(ours, p, jnp.float32(x)), step(theirs, p, jnp.float32(x))
        assert_bits_equal(a[1:], b[1:], f"x={x}")
        assert_bits_equal((a[0].scale, a[0].fin_steps), (b[0].scale, b[0].fin_steps), f"x={x}")
        ours, theirs = a[0], b[0]
    # Flax's scale starts as a Python float, so its step traces a second time; ours once.
    assert step._cache_size() == 2
    step._clear_cache()
    ours = compat.flax.DynamicScale(**kw)
    for x in [1.0, np.inf, 1.0]:
        ours = step(ours, p, jnp.float32(x))[0]
    assert step._cache_size() == 1
