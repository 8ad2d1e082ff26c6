"""Data parallel: every device takes the same skip decision.

Runs on the 8 fake CPU devices that conftest.py sets up, under ``jax.pmap``, under
``jax.shard_map`` (one and two mesh axes) and under ``jax.jit`` with sharded global arrays.
References: a plain-Python model of ``DynamicScale`` (written from the documented rule),
``optax.adam`` applied by hand to the averaged unscaled gradients, and a float32
single-device run of the same global batch. The multi-process test starts two processes
(``tests/data_parallel_worker.py``) that talk over gloo on localhost.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_same_on_every_device, replicate  # tests/ is on sys.path under pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from reference_scalers import ReferenceDynamic

import lossscale_jax as lsj
from lossscale_jax.engine import _skip  # which formulations a process traces

# Slow (make test-fast leaves it out): pmap, shard_map and sharded jit on 8 devices, and 2
# processes.
pytestmark = [pytest.mark.slow, pytest.mark.multidevice]

N = 8
AXIS = "batch"
AXES_2D = ("replica", "data")
LR = 1e-2
F16_MAX = 65504.0
WORKER = pathlib.Path(__file__).resolve().parent / "data_parallel_worker.py"


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
    if jax.device_count() < N:
        pytest.skip(f"needs {N} devices (conftest sets 8 CPU devices), got {jax.device_count()}")


# --------------------------------------------------------------------------
# References, written from the documented rules and independent of the library.


def reference_dynamic_scale(policy: lsj.DynamicScale, overflows) -> list[dict]:
    """The ``DynamicScale`` rule in plain Python (float32 arithmetic), one dict per step."""
    ref = ReferenceDynamic(policy)
    out = []
    total = skipped = 0
    for ov in overflows:
        ov = bool(ov)
        scale, _, _ = ref.step(ov)
        total += 1
        skipped += ov
        out.append(
            dict(
                scale=np.float32(scale),
                growth_count=ref.growth,
                hysteresis_count=ref.hyst,
                last_skipped=ov,
                total_steps=total,
                overflow_steps=skipped,
                skipped_steps=skipped,
            )
        )
    return out


# --------------------------------------------------------------------------
# The step under test: local scaled gradients in, every device's state out.


def make_tx(policy, mode="ieee", average="after", axis_name=AXIS, attribution="reduced"):
    """Adam wrapped in loss scaling; ``average`` says where the gradient mean happens.

    ``"before"``: the user averages the scaled gradients, then calls ``tx.update``.
    ``"after"``: ``tx.update`` sees the local gradients; the mean runs inside the inner
    transformation, on unscaled float32 gradients, once the skip decision is taken.
    """
    inner = optax.adam(LR)
    if average == "after":
        mean_axes = axis_name if axis_name is not None else AXIS
        inner = optax.chain(optax.stateless(lambda g, p: lax.pmean(g, mean_axes)), inner)
    return lsj.loss_scaling(
        inner, policy, overflow=mode, axis_name=axis_name, attribution=attribution
    )


def update_step(tx, average, mean_axes=AXIS):
    def step(params, opt_state, grads):
        if average == "before":
            grads = lax.pmean(grads, mean_axes)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def mapped(mapper, step, num_args=1):
    """``step`` run on 8 devices: ``fn(params, opt_state, *per_device_args)``.

    ``per_device_args`` have a leading axis of size 8 (one slice per device). The result
    is (params, opt_state) as NumPy arrays with a leading device axis: under ``shard_map``
    the state goes in replicated (``P()``) and comes back with one copy per device, so the
    test sees what every device holds. Compiled once per returned function.
    """
    if mapper == "pmap":
        pfn = jax.pmap(step, axis_name=AXIS)

        def run(params, opt_state, *args):
            out = pfn(replicate(params, N), replicate(opt_state, N), *args)
            return jax.tree_util.tree_map(np.asarray, out)

        return run
    if mapper == "shard_map":
        mesh = jax.make_mesh((N,), (AXIS,), devices=jax.devices()[:N])
        spec = P(AXIS)
    else:  # "shard_map_2d": two mesh axes, reduced with a tuple axis_name
        mesh = jax.make_mesh((2, N // 2), AXES_2D, devices=jax.devices()[:N])
        spec = P(AXES_2D)

    def body(params, opt_state, *args):
        args = jax.tree_util.tree_map(lambda a: a[0], args)  # drop the device axis (size 1)
        out = step(params, opt_state, *args)
        return jax.tree_util.tree_map(lambda a: a[None], out)

    sfn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), *[spec] * num_args), out_specs=spec)
    )

    def run(params, opt_state, *args):
        args = [jax.device_put(a, NamedSharding(mesh, spec)) for a in args]
        return jax.tree_util.tree_map(np.asarray, sfn(params, opt_state, *args))

    return run


def run_mapped(mapper, step, params, opt_state, per_device_args):
    """One call of ``mapped(mapper, step)``."""
    return mapped(mapper, step, len(per_device_args))(params, opt_state, *per_device_args)


PARAMS = {
    "w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(3, 2),
    "b": jnp.zeros(2, jnp.float32),
}


def local_grads(values_w, values_b=None):
    """Float16 scaled gradients, one slice per device."""
    w = np.asarray(values_w, np.float16)
    b = np.ones((N, 2), np.float16) if values_b is None else np.asarray(values_b, np.float16)
    return {"w": w, "b": b}


def axis_for(mapper):
    return AXES_2D if mapper == "shard_map_2d" else AXIS


@pytest.mark.parametrize(
    "mapper,average",
    [
        ("pmap", "before"),
        ("pmap", "after"),
        ("shard_map", "after"),
        ("shard_map_2d", "before"),
        ("shard_map_2d", "after"),
    ],
)
def test_one_device_inf_all_skip(mapper, average):
    axes = axis_for(mapper)
    policy = lsj.DynamicScale(init_scale=2.0**10)
    tx = make_tx(policy, "ieee", average, axis_name=axes)
    step = update_step(tx, average, axes)
    rng = np.random.default_rng(0)
    clean = rng.uniform(-4.0, 4.0, (N, 3, 2)).astype(np.float16)
    poisoned = clean.copy()
    poisoned[3, 1, 0] = np.inf  # only device 3 overflows

    run = mapped(mapper, step)
    params1, state1 = run(PARAMS, tx.init(PARAMS), local_grads(poisoned))
    assert_same_on_every_device((params1, state1), N)
    ls = lsj.get_loss_scale_state(state1)
    np.testing.assert_array_equal(ls.last_skipped, True)
    np.testing.assert_array_equal(ls.scale, np.float32(2.0**9))
    np.testing.assert_array_equal(ls.skipped_steps, 1)
    adam = state1.inner_state[-1][0] if average == "after" else state1.inner_state[0]
    np.testing.assert_array_equal(adam.count, 0)  # Adam did not advance on any device
    for k in PARAMS:
        np.testing.assert_array_equal(params1[k], np.broadcast_to(PARAMS[k], params1[k].shape))

    # A clean step after it: every device applies the same Adam step, the one optax.adam
    # computes from the mean of the unscaled gradients.
    first = jax.tree_util.tree_map(lambda a: a[0], (params1, state1))
    params2, state2 = run(*first, local_grads(clean))
    assert_same_on_every_device((params2, state2), N)
    scale = np.float32(2.0**9)
    mean_g = {
        "w": (clean.astype(np.float32) / scale).mean(0),
        "b": np.full(2, np.float32(1.0) / scale),
    }
    adam = optax.adam(LR)
    expected_updates, _ = adam.update(mean_g, adam.init(PARAMS), PARAMS)
    expected = optax.apply_updates(PARAMS, expected_updates)
    for k in PARAMS:
        np.testing.assert_allclose(params2[k][0], expected[k], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(lsj.get_loss_scale_state(state2).skipped_steps, 1)


def test_without_axis_name_devices_disagree():
    """The control: with local checks and no reduction, only device 3 skips.

    Under pmap an update with neither axis_name nor local_axes is refused at trace time (JAX
    does not say whether the gradients vary over the axis); local_axes asks for exactly this.
    """
    grads = np.ones((N, 3, 2), np.float16)
    grads[3, 0, 0] = np.inf
    unreduced = lsj.loss_scaling(optax.adam(LR), lsj.DynamicScale(init_scale=2.0**10))
    with pytest.raises(ValueError, match="runs under the mapped axis 'batch'"):
        run_mapped(
            "pmap",
            update_step(unreduced, "none"),
            PARAMS,
            unreduced.init(PARAMS),
            [local_grads(grads)],
        )
    tx = lsj.loss_scaling(optax.adam(LR), lsj.DynamicScale(init_scale=2.0**10), local_axes=AXIS)
    params, state = run_mapped(
        "pmap", update_step(tx, "none"), PARAMS, tx.init(PARAMS), [local_grads(grads)]
    )
    skipped = np.asarray(lsj.get_loss_scale_state(state).last_skipped)
    np.testing.assert_array_equal(skipped, np.arange(N) == 3)
    # With the reduction the same input makes all of them skip.
    tx = lsj.loss_scaling(optax.adam(LR), lsj.DynamicScale(init_scale=2.0**10), axis_name=AXIS)
    params, state = run_mapped(
        "pmap", update_step(tx, "none"), PARAMS, tx.init(PARAMS), [local_grads(grads)]
    )
    np.testing.assert_array_equal(lsj.get_loss_scale_state(state).last_skipped, True)
    assert_same_on_every_device((params, state), N)


def test_fused_apply_gradients_same_decision():
    """``lsj.apply_gradients`` takes the flag through the same reduction as ``tx.update``."""
    tx = make_tx(lsj.DynamicScale(init_scale=2.0**10), "ieee", "after")
    grads = np.ones((N, 3, 2), np.float16)
    grads[6, 2, 0] = -np.inf

    def fused(params, opt_state, grads):
        return lsj.apply_gradients(tx, grads, opt_state, params)

    params, state = run_mapped("pmap", fused, PARAMS, tx.init(PARAMS), [local_grads(grads)])
    assert_same_on_every_device((params, state), N)
    np.testing.assert_array_equal(lsj.get_loss_scale_state(state).last_skipped, True)
    np.testing.assert_array_equal(state.inner_state[-1][0].count, 0)


@pytest.mark.parametrize("mode", ["saturating", "both"])
@pytest.mark.parametrize("mapper", ["pmap", "shard_map"])
def test_saturated_values_that_cancel_in_the_mean_still_skip(mapper, mode):
    grads = np.ones((N, 3, 2), np.float16)
    grads[0, 2, 1] = F16_MAX  # what a saturating device writes for +overflow
    grads[5, 2, 1] = -F16_MAX  # and another device for -overflow, in the same leaf

    # A mean-only approach: the mean is finite and below the threshold, nothing is seen.
    mean_only = jax.pmap(lambda g: lsj.check_overflow(lax.pmean(g, AXIS), mode), axis_name=AXIS)(
        grads
    )
    np.testing.assert_array_equal(mean_only, False)

    tx = make_tx(lsj.DynamicScale(init_scale=2.0**10), mode, "after")
    params, state = run_mapped(
        mapper, update_step(tx, "after"), PARAMS, tx.init(PARAMS), [local_grads(grads)]
    )
    assert_same_on_every_device((params, state), N)
    ls = lsj.get_loss_scale_state(state)
    np.testing.assert_array_equal(ls.last_skipped, True)
    np.testing.assert_array_equal(ls.scale, np.float32(2.0**9))
    np.testing.assert_array_equal(state.inner_state[-1][0].count, 0)


# --------------------------------------------------------------------------
# A missing axis_name is refused when the update is traced (what JAX lets it see).


def _shard_map_update(tx, *, average_first=False, check_vma=True, values=None):
    """The update under shard_map over AXIS, on each device's gradients (or their mean):
    ``values`` (N, 3, 2), ones by default."""
    mesh = jax.make_mesh((N,), (AXIS,), devices=jax.devices()[:N])

    def body(params, opt_state, g):
        g = jax.tree_util.tree_map(lambda a: a[0], g)
        if average_first:
            g = lax.pmean(g, AXIS)
        updates, opt_state = tx.update(g, opt_state, params)
        out = optax.apply_updates(params, updates), opt_state
        return jax.tree_util.tree_map(lambda a: a[None], out)

    fn = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=P(AXIS), check_vma=check_vma
        )
    )
    grads = local_grads(np.ones((N, 3, 2)) if values is None else values)
    grads = jax.device_put(grads, NamedSharding(mesh, P(AXIS)))
    return lambda: fn(PARAMS, tx.init(PARAMS), grads)


def test_a_process_with_a_gpu_traces_both_skips_under_shard_map(monkeypatch):
    """A process whose platforms skip differently (a GPU beside the CPU: ``_skip.here``) traces
    the conditional and the select, and ``platform_dependent`` needs them to agree in what
    varies over shard_map's axes: with each device deciding for itself (``local_axes``), the
    select's outputs vary over the axis where the conditional's need not. The step runs, and
    gives the bits the conditional alone gives: device 0 skips its inf, the others step."""
    values = np.ones((N, 3, 2))
    values[0, 1, 1] = np.inf
    local = lsj.loss_scaling(optax.adam(LR), lsj.DynamicScale(), local_axes=AXIS)
    want = _shard_map_update(local, values=values)()
    monkeypatch.setattr(_skip, "here", lambda: {"cond", "select"})
    got = _shard_map_update(local, values=values)()
    skipped = np.asarray(got[1].loss_scale.last_skipped)
    assert skipped[0] and not skipped[1:].any(), skipped
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_missing_axis_name_is_refused_where_jax_shows_the_axis():
    policy = lsj.DynamicScale()
    plain = lsj.loss_scaling(optax.adam(LR), policy)
    # shard_map, each device's own gradients: certain disagreement.
    with pytest.raises(ValueError, match="'batch' .* and the gradients vary over it"):
        _shard_map_update(plain)()
    # pmap, or shard_map(check_vma=False): JAX does not say what varies.
    with pytest.raises(ValueError, match="JAX does not say here whether the gradients vary"):
        _shard_map_update(plain, average_first=True, check_vma=False)()
    with pytest.raises(ValueError, match="JAX does not say here whether the gradients vary"):
        run_mapped(
            "pmap",
            update_step(plain, "before"),
            PARAMS,
            plain.init(PARAMS),
            [local_grads(np.ones((N, 3, 2)))],
        )
    # Gradients already averaged (the same on every device): fine in "ieee" mode ...
    _, state = _shard_map_update(plain, average_first=True)()
    assert_same_on_every_device(state, N)
    # ... refused in "saturating"/"both", where +-65504 can cancel in the mean.
    for mode in ("saturating", "both"):
        sat = lsj.loss_scaling(optax.adam(LR), policy, overflow=mode)
        with pytest.raises(ValueError, match="the gradients are the same on every device"):
            _shard_map_update(sat, average_first=True)()
    # The opt-outs: axis_name reduces the flag; local_axes keeps each device's own decision.
    reduced = lsj.loss_scaling(optax.adam(LR), policy, axis_name=AXIS)
    _shard_map_update(reduced, average_first=True)()
    local = lsj.loss_scaling(optax.adam(LR), policy, local_axes=AXIS)
    _shard_map_update(local)()
    with pytest.raises(ValueError, match="local_axes and axis_name both name"):
        lsj.loss_scaling(optax.adam(LR), policy, axis_name=AXIS, local_axes=AXIS)
    # A second mesh axis left out of axis_name is named.
    mesh2 = jax.make_mesh((2, N // 2), AXES_2D, devices=jax.devices()[:N])
    half = lsj.loss_scaling(optax.adam(LR), policy, axis_name="data")

    def body(p, s, g):
        return half.update(jax.tree_util.tree_map(lambda a: a[0], g), s, p)[1].loss_scale.scale

    g = jax.device_put(local_grads(np.ones((N, 3, 2))), NamedSharding(mesh2, P(AXES_2D)))
    sm = jax.shard_map(body, mesh=mesh2, in_specs=(P(), P(), P(AXES_2D)), out_specs=P())
    with pytest.raises(ValueError, match="mapped axis 'replica'"):
        jax.jit(sm)(PARAMS, half.init(PARAMS), g)


def test_multi_steps_under_shard_map_accumulates_per_device():
    """Each device accumulates its own gradients; one device's overflow skips every window."""
    mesh = jax.make_mesh((N,), (AXIS,), devices=jax.devices()[:N])
    average = optax.stateless(lambda g, p: lax.pmean(g, AXIS))
    tx = lsj.loss_scaling_multi_steps(
        optax.chain(average, optax.sgd(1.0)), lsj.StaticScale(4.0), 2, axis_name=AXIS
    )

    def body(params, opt_state, g1, g2):
        for g in (g1, g2):
            g = jax.tree_util.tree_map(lambda a: a[0], g)
            updates, opt_state = tx.update(g, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, lsj.get_loss_scale_state(opt_state).last_skipped

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)), out_specs=P())
    )
    put = lambda a: jax.device_put(local_grads(a), NamedSharding(mesh, P(AXIS)))  # noqa: E731
    clean = np.full((N, 3, 2), 4.0)
    poisoned = clean.copy()
    poisoned[5, 0, 1] = np.inf
    params, skipped = fn(PARAMS, tx.init(PARAMS), put(clean), put(clean))
    assert not bool(skipped)
    np.testing.assert_array_equal(params["w"], PARAMS["w"] - 1.0)  # mean of 4/4 over 2 and 8
    params, skipped = fn(PARAMS, tx.init(PARAMS), put(clean), put(poisoned))
    assert bool(skipped)
    np.testing.assert_array_equal(params["w"], PARAMS["w"])


# --------------------------------------------------------------------------
# A model trained for many steps: one compiled scan, random injections.

FEATURES, LOCAL_BATCH = 3, 4
W_TRUE = np.array([[0.5, -1.0], [2.0, 0.25], [-0.75, 1.5]], np.float32)


def loss_fn(params, x, y, dtype=jnp.float16):
    p = jax.tree_util.tree_map(lambda a: a.astype(dtype), params)
    pred = x.astype(dtype) @ p["w"] + p["b"]
    return jnp.mean((pred - y.astype(dtype)) ** 2).astype(jnp.float32)


def make_data(steps, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, N * LOCAL_BATCH, FEATURES)).astype(np.float32)
    y = (x @ W_TRUE + 0.1 * rng.normal(size=(steps, N * LOCAL_BATCH, 2))).astype(np.float32)
    return x.astype(np.float16), y.astype(np.float16)


def per_device(a):
    """(steps, N * B, ...) -> (N, steps, B, ...): device d gets rows d*B:(d+1)*B."""
    steps = a.shape[0]
    return np.moveaxis(a.reshape(steps, N, LOCAL_BATCH, *a.shape[2:]), 1, 0)


def trajectory_fields(ls):
    return {
        "scale": ls.scale,
        "growth_count": ls.growth_count,
        "hysteresis_count": ls.hysteresis_count,
        "last_skipped": ls.last_skipped,
        "total_steps": ls.total_steps,
        "overflow_steps": ls.overflow_steps,
        "skipped_steps": ls.skipped_steps,
    }


def float32_reference(x, y, skip):
    """One device, float32, the global batch, Adam applied on the steps that are not skipped."""
    adam = optax.adam(LR)

    @jax.jit
    def run(params, xs, ys, skips):
        def body(carry, inp):
            params, opt = carry
            xb, yb, s = inp
            g = jax.grad(loss_fn)(params, xb, yb, jnp.float32)
            u, new_opt = adam.update(g, opt, params)
            new = (optax.apply_updates(params, u), new_opt)
            return jax.tree_util.tree_map(lambda a, b: jnp.where(s, a, b), (params, opt), new), None

        return lax.scan(body, (params, adam.init(params)), (xs, ys, skips))[0][0]

    return run(PARAMS, x.astype(np.float32), y.astype(np.float32), skip)


POISONS = np.array([0.0, np.inf, -np.inf, np.nan, F16_MAX, -F16_MAX], np.float16)


def test_random_injections_200_steps_bit_identical():
    steps = 200
    policy = lsj.DynamicScale(init_scale=2.0**6, growth_interval=4, hysteresis=2, max_scale=2.0**9)
    tx = make_tx(policy, "both", "after")
    x, y = make_data(steps, seed=1)
    rng = np.random.default_rng(2)
    hit = rng.random((steps, N)) < 0.03
    kind = rng.integers(1, len(POISONS), (steps, N))
    poison = np.where(hit, POISONS[kind], np.float16(0)).astype(np.float16)
    poisoned = hit  # which (step, device) pairs write an overflow into their gradient

    def train(params, opt_state, xs, ys, poison, poisoned):
        def body(carry, inp):
            params, opt_state = carry
            xb, yb, pv, pz = inp
            grads = jax.grad(lambda p: lsj.scale_loss(loss_fn(p, xb, yb), opt_state))(params)
            w = grads["w"].astype(jnp.float16)
            grads = {
                "w": w.at[0, 0].set(jnp.where(pz, pv, w[0, 0])),
                "b": grads["b"].astype(jnp.float16),
            }
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return (params, opt_state), trajectory_fields(lsj.get_loss_scale_state(opt_state))

        return lax.scan(body, (params, opt_state), (xs, ys, poison, poisoned))

    fn = jax.pmap(train, axis_name=AXIS)
    (params, state), traj = fn(
        replicate(PARAMS, N),
        replicate(tx.init(PARAMS), N),
        per_device(x),
        per_device(y),
        poison.T,
        poisoned.T,
    )
    assert_same_on_every_device((params, state, traj), N)

    overflow = poisoned.any(axis=1)
    assert 20 < overflow.sum() < 120  # the run exercises both branches
    ref = reference_dynamic_scale(policy, overflow)
    for field in ref[0]:
        expected = np.array([r[field] for r in ref])
        np.testing.assert_array_equal(np.asarray(traj[field])[0], expected, err_msg=field)
    assert len(set(np.asarray(traj["scale"])[0].tolist())) > 2  # the scale moved both ways

    np.testing.assert_array_equal(state.inner_state[-1][0].count, steps - overflow.sum())
    expected = float32_reference(x, y, overflow)
    for k in PARAMS:
        np.testing.assert_allclose(params[k][0], expected[k], rtol=2e-3, atol=2e-4)


# --------------------------------------------------------------------------
# The cost: one all-reduce (the flag, and the per-leaf record when it is reduced).

# "%name = SHAPE all-reduce(" where SHAPE is "f32[4,2]{1,0}" or a tuple "(f32[2]{0}, s32[])".
ALL_REDUCE = re.compile(r"=\s*(\(.*?\)|\S+)\s+all-reduce(?:-start)?\(")


def all_reduce_shapes(hlo_text: str) -> list[str]:
    """One entry per all-reduce: its operand shapes, layouts dropped, tuple parts sorted."""
    out = []
    for shape in ALL_REDUCE.findall(hlo_text):
        parts = re.findall(r"[a-z]+\d*\[[\d,]*\]", shape)
        out.append(", ".join(sorted(parts)))
    return sorted(out)


@pytest.mark.parametrize(
    "mapper,average,attribution",
    [("pmap", "before", "reduced"), ("shard_map", "after", "reduced"), ("pmap", "before", "local")],
)
def test_one_extra_all_reduce(mapper, average, attribution):
    """One all-reduce more than the plain step: the flag alone (s32[]) with a local per-leaf
    record; the flag and the record together (s32[n_leaves + 1]) with a reduced one."""
    x, y = make_data(1, seed=3)
    xs, ys = per_device(x)[:, 0], per_device(y)[:, 0]
    policy = lsj.DynamicScale()
    scaled_tx = make_tx(policy, "saturating", average, attribution=attribution)
    plain_tx = optax.adam(LR)
    if average == "after":
        plain_tx = optax.chain(optax.stateless(lambda g, p: lax.pmean(g, AXIS)), plain_tx)

    def step_for(tx, scaled):
        def step(params, opt_state, xb, yb):
            if scaled:
                loss = lambda p: lsj.scale_loss(loss_fn(p, xb, yb), opt_state)  # noqa: E731
            else:
                loss = lambda p: loss_fn(p, xb, yb)  # noqa: E731
            local = params
            if mapper == "shard_map":  # local gradients, not ones summed by shard_map's AD
                local = lax.pcast(params, AXIS, to="varying")
            grads = jax.grad(loss)(local)
            if average == "before":
                grads = lax.pmean(grads, AXIS)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return step

    def compiled_text(tx, scaled):
        step = step_for(tx, scaled)
        if mapper == "pmap":
            fn = jax.pmap(step, axis_name=AXIS)
            lowered = fn.lower(replicate(PARAMS, N), replicate(tx.init(PARAMS), N), xs, ys)
        else:
            mesh = jax.make_mesh((N,), (AXIS,), devices=jax.devices()[:N])
            fn = jax.jit(
                jax.shard_map(
                    step, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)), out_specs=(P(), P())
                )
            )
            bx = x[0].reshape(N * LOCAL_BATCH, FEATURES)
            by = y[0].reshape(N * LOCAL_BATCH, 2)
            shard = NamedSharding(mesh, P(AXIS))
            lowered = fn.lower(
                PARAMS, tx.init(PARAMS), jax.device_put(bx, shard), jax.device_put(by, shard)
            )
        return lowered.compile().as_text()

    plain = all_reduce_shapes(compiled_text(plain_tx, False))
    scaled = all_reduce_shapes(compiled_text(scaled_tx, True))
    assert plain, "the plain data-parallel step must average its gradients"
    extra = list(scaled)
    for s in plain:
        extra.remove(s)  # raises if the scaled step lost one of the plain all-reduces
    assert len(extra) == 1, (plain, scaled)
    if attribution == "local":
        assert re.fullmatch(r"[a-z]+\d*\[\]", extra[0]), extra  # one scalar operand
    else:
        n_leaves = len(jax.tree_util.tree_leaves(PARAMS))
        assert extra[0] == f"s32[{n_leaves + 1}]", extra


# --------------------------------------------------------------------------
# jit with sharded global arrays: no axis_name, the reduction is global.


def mesh_1d(axis_type=AxisType.Auto):
    return jax.make_mesh((N,), (AXIS,), axis_types=(axis_type,), devices=jax.devices()[:N])


def sharded_update(mode, sharding):
    """A jitted Adam step with loss scaling (no axis_name) on arrays placed by ``sharding``."""
    tx = lsj.loss_scaling(optax.adam(LR), lsj.DynamicScale(init_scale=2.0**10), overflow=mode)

    @jax.jit
    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def run(grads_w):
        params = {"w": jax.device_put(jnp.zeros(grads_w.shape, jnp.float32), sharding)}
        return step(params, tx.init(params), {"w": jax.device_put(grads_w, sharding)})

    return run


@pytest.mark.parametrize(
    "case,axis_type",
    [
        ("inf_in_one_shard", AxisType.Auto),
        ("saturated_pair_in_two_shards", AxisType.Auto),
        ("saturated_pair_in_two_shards", AxisType.Explicit),
    ],
    ids=str,
)
def test_sharded_jit_global_check(case, axis_type):
    mesh = mesh_1d(axis_type)
    sharding = NamedSharding(mesh, P(AXIS))
    g = np.ones((N, 4), np.float16)  # row d lives on device d
    if case == "inf_in_one_shard":
        mode = "ieee"
        g[6, 1] = np.inf
    else:
        mode = "saturating"
        g[1, 2], g[4, 2] = F16_MAX, -F16_MAX
    run = sharded_update(mode, sharding)
    params, state = run(g)
    ls = lsj.get_loss_scale_state(state)
    for leaf in jax.tree_util.tree_leaves(ls) + [state.inner_state[0].count]:
        copies = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert len(copies) == N and leaf.sharding.is_fully_replicated
        assert all(c.tobytes() == copies[0].tobytes() for c in copies)
    assert bool(ls.last_skipped) and float(ls.scale) == 2.0**9
    assert int(state.inner_state[0].count) == 0
    np.testing.assert_array_equal(params["w"], 0.0)

    # The same input without the bad values takes the step (the check is not stuck on).
    params, state = run(np.ones((N, 4), np.float16))
    assert not bool(lsj.get_loss_scale_state(state).last_skipped)
    assert int(state.inner_state[0].count) == 1


def test_sharded_jit_trajectory_matches_pmap():
    steps = 40
    policy = lsj.DynamicScale(init_scale=2.0**6, growth_interval=3, max_scale=2.0**9)
    x, y = make_data(steps, seed=4)
    poison_rows = {5: 3, 6: 3, 17: 0, 18: 7, 30: 5}  # step -> device whose batch is poisoned
    for t, d in poison_rows.items():
        x[t, d * LOCAL_BATCH + 1, 0] = np.inf

    def scan_steps(tx, average):
        def train(params, opt_state, xs, ys):
            def body(carry, inp):
                params, opt_state = carry
                xb, yb = inp
                grads = jax.grad(lambda p: lsj.scale_loss(loss_fn(p, xb, yb), opt_state))(params)
                if average == "before":
                    grads = lax.pmean(grads, AXIS)
                updates, opt_state = tx.update(grads, opt_state, params)
                params = optax.apply_updates(params, updates)
                return (params, opt_state), trajectory_fields(lsj.get_loss_scale_state(opt_state))

            return lax.scan(body, (params, opt_state), (xs, ys))

        return train

    # pmap: local batches, gradients averaged before the update, flag reduced over "batch".
    tx = make_tx(policy, "ieee", "before")
    (p_params, _), p_traj = jax.pmap(scan_steps(tx, "before"), axis_name=AXIS)(
        replicate(PARAMS, N), replicate(tx.init(PARAMS), N), per_device(x), per_device(y)
    )
    assert_same_on_every_device((p_params, p_traj), N)

    # jit: one global batch sharded over the 8 devices, no axis_name anywhere.
    mesh = mesh_1d()
    shard = NamedSharding(mesh, P(None, AXIS))
    tx = lsj.loss_scaling(optax.adam(LR), policy)
    (j_params, j_state), j_traj = jax.jit(scan_steps(tx, "none"))(
        PARAMS, tx.init(PARAMS), jax.device_put(x, shard), jax.device_put(y, shard)
    )

    overflow = np.zeros(steps, bool)
    overflow[list(poison_rows)] = True
    ref = reference_dynamic_scale(policy, overflow)
    for field in ref[0]:
        expected = np.array([r[field] for r in ref])
        np.testing.assert_array_equal(np.asarray(p_traj[field])[0], expected, err_msg=field)
        np.testing.assert_array_equal(np.asarray(j_traj[field]), expected, err_msg=field)
    for k in PARAMS:
        np.testing.assert_allclose(j_params[k], p_params[k][0], rtol=1e-3, atol=1e-4)
        for shard_ in j_params[k].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard_.data), np.asarray(j_params[k]))
    assert int(j_state.inner_state[0].count) == steps - overflow.sum()


def test_a_policys_own_state_is_the_same_on_every_device():
    """fairseq's scaler with tolerance > 0 keeps two counters in policy_state: under pmap each
    device's counters, scale and skips follow the one reduced decision, and the transcribed
    fairseq rule over the steps where any device overflowed."""
    from reference_torch_world import FairseqDynamicLossScaler

    steps, cfg = 30, dict(init_scale=2.0**6, scale_window=4, tolerance=0.3)
    policy = lsj.compat.fairseq.DynamicLossScaler(**cfg)
    x, y = make_data(steps, seed=5)
    poison_rows = {3: 1, 9: 6, 10: 2, 11: 0, 20: 4, 24: 7}  # some tolerated, some backed off
    for t, d in poison_rows.items():
        x[t, d * LOCAL_BATCH, 1] = np.inf
    tx = make_tx(policy, "ieee", "before")

    def train(params, opt_state, xs, ys):
        def body(carry, inp):
            params, opt_state = carry
            grads = jax.grad(lambda p: lsj.scale_loss(loss_fn(p, *inp), opt_state))(params)
            updates, opt_state = tx.update(lax.pmean(grads, AXIS), opt_state, params)
            ls = lsj.get_loss_scale_state(opt_state)
            return (optax.apply_updates(params, updates), opt_state), (
                ls.scale,
                ls.last_skipped,
                ls.policy_state,
            )

        return lax.scan(body, (params, opt_state), (xs, ys))

    _, (scale, skipped, own) = jax.pmap(train, axis_name=AXIS)(
        replicate(PARAMS, N), replicate(tx.init(PARAMS), N), per_device(x), per_device(y)
    )
    assert_same_on_every_device((scale, skipped, own), N)
    ref = FairseqDynamicLossScaler(**cfg)
    tolerated = 0
    for t in range(steps):
        want_scale, want_skipped = ref.step(t in poison_rows)
        assert float(scale[0, t]) == want_scale and bool(skipped[0, t]) == want_skipped, t
        assert int(own["iter_since_rescale"][0, t]) == ref._iter - ref._last_rescale_iter, t
        assert int(own["overflows_since_rescale"][0, t]) == ref._overflows_since_rescale, t
        tolerated += t in poison_rows and ref._overflows_since_rescale > 0
    assert tolerated and not ref.raised


# --------------------------------------------------------------------------
# Two processes, two CPU devices each, gloo collectives over localhost.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_multi_process_every_device_skips(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["JAX_PLATFORMS"] = "cpu"
    procs = []
    for pid in range(2):
        out = tmp_path / f"process{pid}.json"
        procs.append(
            (
                out,
                subprocess.Popen(
                    [sys.executable, str(WORKER), str(pid), "2", str(port), str(out)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                ),
            )
        )
    logs = []
    try:
        for _, p in procs:
            logs.append(p.communicate(timeout=60)[0])
    except subprocess.TimeoutExpired:
        for _, p in procs:
            p.kill()
        pytest.fail(
            "the multi-process run did not finish in 60 s:\n"
            + "\n".join(p.communicate()[0] for _, p in procs)
        )
    for (_, p), log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log

    results = [json.loads(out.read_text()) for out, _ in procs]
    devices = [dev for r in results for dev in r["devices"]]
    assert len(devices) == 4  # 2 processes x 2 devices
    assert {d["process"] for d in devices} == {0, 1}
    for d in devices[1:]:
        assert d["state"] == devices[0]["state"]  # bit-identical (hex floats, ints, bools)
    overflow = results[0]["overflow_steps_expected"]
    assert results[1]["overflow_steps_expected"] == overflow
    policy = lsj.DynamicScale(**results[0]["policy"])
    ref = reference_dynamic_scale(policy, overflow)
    traj = devices[0]["state"]["trajectory"]
    assert [float.fromhex(s) for s in traj["scale"]] == [float(r["scale"]) for r in ref]
    assert traj["last_skipped"] == [r["last_skipped"] for r in ref]
    assert devices[0]["state"]["adam_count"] == len(overflow) - sum(overflow)
