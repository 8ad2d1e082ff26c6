"""The seams a new user tried, each a defect of a hand-kept copy of the step (issue 22).

Each test here failed before the step was written once (``lossscale_jax/engine/_engine.py``):
accumulation with a policy that never skips, ``compat.torch.multi_optimizer``'s own
copy of the step, a pmap-replicated state at the checkpoint and policy seams, an
accumulation checkpoint moved between DynamicScale and HeadroomScale, the messages of
two common mistakes, metrics read between the micro-batches of a window, and what
``import lossscale_jax`` loads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization
from helpers import replicate, run_python  # tests/ is on sys.path under pytest
from jax.experimental import checkify

import lossscale_jax as lsj
from lossscale_jax import compat

F16 = jnp.float16


# ------------------------------------------------------------------ 1. non-skipping policies


@pytest.mark.parametrize(
    "policy",
    [lsj.NoScale(), lsj.StaticScale(1.0, skip_on_overflow=False)],
    ids=["NoScale", "StaticScale-no-skip"],
)
@pytest.mark.parametrize("order", [(1.0, np.inf, 4.0), (np.inf, 1.0, 4.0), (1.0, 4.0, np.inf)])
def test_a_policy_that_never_skips_leaves_out_only_the_bad_micro_batch(policy, order):
    """The documented rule: the overflowing micro-batch is left out of the sum, the window
    applies the others' sum over every_k: -(1 + 4) * float32(1 / 3) here, in every order
    (the mean is the sum times the float32 reciprocal of every_k)."""
    tx = lsj.loss_scaling_multi_steps(optax.sgd(1.0), policy, every_k=3)
    params = {"w": jnp.zeros([1], jnp.float32)}
    state = tx.init(params)
    for g in order:
        updates, state = tx.update({"w": jnp.array([g], F16)}, state, params)
    assert not bool(state.loss_scale.last_skipped)
    expected = -(np.float32(1.0) + np.float32(4.0)) * (np.float32(1.0) / np.float32(3.0))
    np.testing.assert_array_equal(np.asarray(updates["w"]), [expected])


# ------------------------------------------------------------------ 2. multi_optimizer


def _two_optimizers(**kwargs):
    return compat.torch.multi_optimizer(
        {"a": optax.sgd(1.0), "b": optax.adam(0.1)},
        {"a": "a", "b": "b"},
        compat.torch.GradScaler(init_scale=4.0),
        **kwargs,
    )


def test_multi_optimizer_skipped_partition_keeps_negative_zero():
    params = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([-0.0, 1.0])}
    tx = _two_optimizers()
    state = tx.init(params)
    grads = {"a": jnp.array([4.0, 8.0]), "b": jnp.array([jnp.inf, 0.0])}
    updates, state = tx.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    assert np.signbit(np.asarray(new["b"])[0])  # -0.0 stays -0.0, as torch keeps it
    np.testing.assert_array_equal(np.asarray(new["a"]), [0.0, 0.0])  # a stepped: 1-1, 2-2
    assert int(state.inner_state.inner_states["b"].inner_state[0].count) == 0  # b frozen


def test_multi_optimizer_keeps_the_per_leaf_record():
    params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    tx = _two_optimizers()
    grads = {"a": jnp.ones(2), "b": jnp.array([jnp.nan, 0.0])}
    _, state = tx.update(grads, tx.init(params), params)
    assert lsj.overflowed_leaves(state, params) == ["['b']"]
    assert int(lsj.metrics(state)["overflow_leaves"]) == 1


def test_multi_optimizer_on_stuck_error_reports_through_checkify():
    params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    tx = compat.torch.multi_optimizer(
        {"a": optax.sgd(1.0), "b": optax.sgd(1.0)},
        {"a": "a", "b": "b"},
        lsj.StaticScale(2.0),
        on_stuck="error",
    )
    grads = {"a": jnp.ones(2), "b": jnp.array([jnp.inf, 0.0])}
    err, _ = checkify.checkify(tx.update)(grads, tx.init(params), params)
    assert err.get() is not None and "stuck" in err.get()


@pytest.mark.multidevice
def test_multi_optimizer_refuses_pmap_without_its_axis():
    n = 2
    params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    tx = _two_optimizers()  # no axis_name
    state = tx.init(params)
    rep = jax.tree_util.tree_map(lambda x: jnp.stack([x] * n), (params, state))

    def step(p, s):
        return tx.update(jax.tree_util.tree_map(jnp.ones_like, p), s, p)[1]

    with pytest.raises(ValueError, match="does not name it") as info:
        jax.pmap(step, axis_name="i", devices=jax.devices()[:n])(*rep)
    assert isinstance(info.value, lsj.errors.AxisError)


@pytest.mark.multidevice
@pytest.mark.slow
def test_multi_optimizer_takes_one_decision_per_label_on_every_device():
    """Under pmap with axis_name, an overflow on one device skips that label everywhere."""
    n = 4
    params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    tx = _two_optimizers(axis_name="i")
    state = tx.init(params)
    rep = jax.tree_util.tree_map(lambda x: jnp.stack([x] * n), (params, state))

    def step(p, s):
        bad = jax.lax.axis_index("i") == 2
        g = {"a": jnp.ones(2), "b": jnp.where(bad, jnp.inf, 1.0) * jnp.ones(2)}
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    new, state = jax.pmap(step, axis_name="i", devices=jax.devices()[:n])(*rep)
    np.testing.assert_array_equal(np.asarray(new["b"]), np.full((n, 2), 0.0))
    np.testing.assert_array_equal(np.asarray(new["a"]), np.full((n, 2), -0.25))
    assert np.all(np.asarray(state.loss_scale.scale) == 2.0)


# ------------------------------------------------------------------ 3. pmap-replicated state


@pytest.mark.multidevice
@pytest.mark.parametrize(
    "policy,scale",
    [(lsj.StaticScale(8.0), 8.0), (lsj.NoScale(), 1.0), (lsj.DynamicScale(), 2.0**15)],
)
def test_switch_policy_on_a_replicated_state(policy, scale):
    params = {"w": jnp.zeros(2)}
    state = replicate(lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale()).init(params), 2)
    moved = lsj.switch_policy(state, policy)
    np.testing.assert_array_equal(np.asarray(moved.loss_scale.scale), [scale, scale])
    assert moved.loss_scale.scale.dtype == jnp.float32


@pytest.mark.multidevice
def test_checkpoint_policy_check_on_a_replicated_state():
    params = {"w": jnp.zeros(2)}
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=8.0))
    state = replicate(tx.init(params), 2)
    encoded = serialization.to_bytes(state)
    restored = lsj.restore_flax(state, encoded, policy=lsj.DynamicScale(init_scale=8.0))
    np.testing.assert_array_equal(np.asarray(restored.loss_scale.scale), [8.0, 8.0])
    lsj.check_checkpoint(
        serialization.to_state_dict(state),
        serialization.to_state_dict(state),
        policy=lsj.StaticScale(8.0),
    )
    with pytest.raises(ValueError, match=r"element \(0,\) of \(2,\)") as info:
        lsj.restore_flax(state, encoded, policy=lsj.StaticScale(4.0))
    assert isinstance(info.value, lsj.errors.CheckpointPolicyError)


@pytest.mark.multidevice
def test_orbax_policy_check_on_a_replicated_state(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params = {"w": jnp.zeros(2)}
    state = replicate(
        lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=8.0)).init(params), 2
    )
    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, state)
    restored = lsj.restore_orbax(path, state, policy=lsj.StaticScale(8.0))
    np.testing.assert_array_equal(np.asarray(restored.loss_scale.scale), [8.0, 8.0])
    with pytest.raises(ValueError, match="another policy") as info:
        lsj.restore_orbax(path, state, policy=lsj.StaticScale(2.0))
    assert isinstance(info.value, lsj.errors.CheckpointPolicyError)


# ------------------------------------------------------------------ 4. accumulation checkpoints


@pytest.mark.slow
@pytest.mark.parametrize(
    "saved_policy,new_policy",
    [
        (lsj.DynamicScale(init_scale=2.0**10), lsj.HeadroomScale(init_scale=2.0**12)),
        (lsj.HeadroomScale(init_scale=2.0**12), lsj.DynamicScale(init_scale=2.0**10)),
    ],
    ids=["dynamic-to-headroom", "headroom-to-dynamic"],
)
def test_accumulation_checkpoint_moves_between_policies(saved_policy, new_policy):
    """The documented path: restore into the new optimizer's state, then switch_policy."""
    params = {"w": jnp.ones(3)}
    old = lsj.loss_scaling_multi_steps(optax.adam(1e-3), saved_policy, every_k=2)
    state = old.init(params)
    for g in (2.0, 3.0, 5.0):  # a completed window and one micro-batch into the next
        _, state = old.update({"w": jnp.full(3, g, F16)}, state, params)
    new = lsj.loss_scaling_multi_steps(optax.adam(1e-3), new_policy, every_k=2)
    restored = lsj.restore_flax(new.init(params), serialization.to_bytes(state))
    resumed = lsj.switch_policy(restored, new_policy)
    assert int(resumed.mini_step) == 1
    assert int(resumed.loss_scale.total_steps) == 1
    _, after = new.update({"w": jnp.full(3, 7.0, F16)}, resumed, params)
    assert int(after.loss_scale.total_steps) == 2 and int(after.mini_step) == 0


def test_an_earlier_accumulation_checkpoint_names_what_each_missing_field_is():
    params = {"w": jnp.ones(3)}
    tx = lsj.loss_scaling_multi_steps(optax.sgd(0.1), lsj.DynamicScale(), every_k=2)
    saved = serialization.to_state_dict(tx.init(params))
    del saved["window_range"]  # what an earlier version saved under DynamicScale
    with pytest.raises(ValueError, match="window_range.*HeadroomScale") as info:
        lsj.restore_flax(tx.init(params), saved)
    assert isinstance(info.value, lsj.errors.CheckpointVersionError)


# ------------------------------------------------------------------ 5. messages


@pytest.mark.multidevice
def test_pmap_without_an_axis_name_says_to_name_it():
    params = {"w": jnp.zeros(2)}
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(), axis_name="batch")
    rep = jax.tree_util.tree_map(lambda x: jnp.stack([x] * 2), (params, tx.init(params)))

    def step(p, s):
        return tx.update(jax.tree_util.tree_map(jnp.ones_like, p), s, p)[1]

    with pytest.raises(ValueError) as info:
        jax.pmap(step, devices=jax.devices()[:2])(*rep)
    assert isinstance(info.value, lsj.errors.AxisError)
    message = str(info.value)
    assert "jax.pmap(step, axis_name='batch')" in message
    assert "_internal" not in message


def test_a_policy_class_instead_of_an_instance_says_to_call_it():
    with pytest.raises(TypeError) as info:
        lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale)  # type: ignore[arg-type]
    message = str(info.value)
    assert isinstance(info.value, lsj.errors.NotAPolicyError)
    assert "DynamicScale(...)" in message and "got the class DynamicScale" in message
    with pytest.raises(TypeError) as info:
        lsj.loss_scaling(optax.sgd(0.1), 2.0**15)  # type: ignore[arg-type]
    assert "TolerantDynamicScale" in str(info.value) and "HeadroomScale" in str(info.value)


# ------------------------------------------------------------------ 6. metrics mid-window


def test_metrics_between_micro_batches_describe_the_last_completed_window():
    params = {"a": jnp.ones(2), "b": jnp.ones(2)}
    tx = lsj.loss_scaling_multi_steps(optax.sgd(0.1), lsj.DynamicScale(), every_k=2)
    state = tx.init(params)
    good, bad = jnp.ones(2, F16), jnp.array([jnp.inf, 1.0], F16)
    _, state = tx.update({"a": good, "b": bad}, state, params)  # mid-window
    m = lsj.metrics(state)
    assert not bool(m["overflow"]) and int(m["overflow_leaves"]) == 0
    assert int(m["first_overflow_leaf"]) == -1 and lsj.overflowed_leaves(state, params) == []
    assert bool(state.window_overflow) and state.window_leaf_overflow.tolist() == [False, True]
    _, state = tx.update({"a": good, "b": good}, state, params)  # the window ends
    m = lsj.metrics(state)
    assert bool(m["overflow"]) and int(m["overflow_leaves"]) == 1
    assert int(m["first_overflow_leaf"]) == 1 and lsj.overflowed_leaves(state, params) == ["['b']"]


# ------------------------------------------------------------------ 7. what import loads


@pytest.mark.slow
def test_import_loads_no_flax_orbax_or_matplotlib_until_used():
    out = run_python(
        """
        import sys
        import lossscale_jax as lsj
        heavy = ("flax", "orbax", "matplotlib", "equinox", "lossscale_jax.compat")
        print(sorted({m.split(".")[0] for m in sys.modules if m.startswith(heavy)}))
        lsj.TrainState
        print("flax" in sys.modules)
        """
    )
    assert out.splitlines() == ["[]", "True"]


@pytest.mark.slow
@pytest.mark.parametrize("flax_first", [False, True])
def test_flax_serialization_round_trips_whichever_is_imported_first(flax_first):
    out = run_python(
        f"""
        if {flax_first}:
            import flax.serialization
        import jax.numpy as jnp, optax
        import lossscale_jax as lsj
        from flax import serialization
        tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=8.0))
        state = tx.init({{"w": jnp.zeros(2)}})
        back = serialization.from_bytes(state, serialization.to_bytes(state))
        print(float(back.loss_scale.scale), type(back.loss_scale).__name__)
        """
    )
    assert out == "8.0 LossScaleState"
