"""Checkpoints: the whole optimizer state (loss-scale state included) saves and restores with
Orbax and flax.serialization, a resumed run is bit-identical to the uninterrupted one, and a
checkpoint of the wrong structure fails with an error that says so."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import serialization
from helpers import assert_bits_equal  # tests/ is on sys.path under pytest

import lossscale_jax as lsj

N_STEPS, SAVE_AT = 14, 5
PARAMS = {"b": jnp.zeros((3,), jnp.float32), "w": jnp.full((4, 3), 0.1, jnp.float32)}
POLICY = lsj.DynamicScale(init_scale=2.0**8, growth_interval=3, hysteresis=2)
BAD_STEPS = {1, 2, 7, 8, 9}  # overflows, two in a row: backoffs, growths, skips all happen

TXS = {
    "adam": lambda: lsj.loss_scaling(optax.adam(1e-2), POLICY),
    # Clipping inside the loss scaling (it sees unscaled gradients), in a one-element chain.
    "chain": lambda: optax.chain(
        lsj.loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)), POLICY)
    ),
    "multi_steps": lambda: lsj.loss_scaling_multi_steps(optax.adam(1e-2), POLICY, 3),
}


def batch(t):
    x = jax.random.normal(jax.random.PRNGKey(t), (8, 4), jnp.float16)
    return x, jnp.ones((8, 3), jnp.float16)


def make_step(tx):
    traces = []

    @jax.jit
    def step(params, opt_state, x, y, bad):
        traces.append(1)
        p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), params)

        def loss(p):
            return jnp.mean((x @ p["w"] + p["b"] - y) ** 2).astype(jnp.float32)

        grads = jax.grad(lambda p: lsj.scale_loss(loss(p), opt_state))(p16)
        grads["w"] = jnp.where(bad, grads["w"].at[0, 0].set(jnp.inf), grads["w"])
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, traces


def run(step, params, opt_state, start, stop):
    for t in range(start, stop):
        params, opt_state = step(params, opt_state, *batch(t), jnp.asarray(t in BAD_STEPS))
    return params, opt_state


def save_orbax(path, tree):
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, tree)


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend,name",
    # Orbax saves take seconds: the two nested forms cover the plain one.
    [("orbax", "chain"), ("orbax", "multi_steps")] + [("flax", name) for name in TXS],
)
def test_resume_is_bit_identical(backend, name, tmp_path):
    tx = TXS[name]()
    step, traces = make_step(tx)
    full = run(step, PARAMS, tx.init(PARAMS), 0, N_STEPS)
    ls = lsj.get_loss_scale_state(full[1])
    assert int(ls.skipped_steps) > 0 and int(ls.total_steps) > 0  # the state is not trivial

    saved = run(step, PARAMS, tx.init(PARAMS), 0, SAVE_AT)
    target = (PARAMS, tx.init(PARAMS))
    if backend == "orbax":
        save_orbax(tmp_path / "ckpt", saved)
        restored = lsj.restore_orbax(tmp_path / "ckpt", target)
    else:
        (tmp_path / "ckpt.msgpack").write_bytes(serialization.to_bytes(saved))
        restored = lsj.restore_flax(target, (tmp_path / "ckpt.msgpack").read_bytes())
        # The plain flax API restores the same thing (LossScaleState is registered).
        assert_bits_equal(restored, serialization.from_bytes(target, serialization.to_bytes(saved)))
    assert_bits_equal(restored, saved)
    resumed = run(step, *restored, SAVE_AT, N_STEPS)
    assert_bits_equal(resumed, full)
    assert len(traces) == 1  # a restored state runs through the same compiled step


def test_flax_state_dict_round_trip_keeps_dtypes():
    state = TXS["adam"]().init(PARAMS)
    sd = serialization.to_state_dict(state)
    assert set(sd["loss_scale"]) == {
        "scale",
        "growth_count",
        "hysteresis_count",
        "last_overflow",
        "last_skipped",
        "stuck",
        "total_steps",
        "overflow_steps",
        "skipped_steps",
        "recent_overflow_rate",
        "range_peak",
        "margin",
        "policy_state",
    }
    assert sd["loss_scale"]["policy_state"] is None  # DynamicScale keeps no state of its own
    assert sd["leaf_overflow"].dtype == np.bool_ and sd["leaf_overflow"].shape == (2,)
    back = lsj.restore_flax(state, sd)
    assert isinstance(back.loss_scale, lsj.LossScaleState)
    assert back.loss_scale.scale.dtype == np.float32
    assert back.loss_scale.total_steps.dtype == np.int32
    assert back.loss_scale.stuck.dtype == np.bool_


def test_checkpoint_without_loss_scaling_is_named(tmp_path):
    target = TXS["adam"]().init(PARAMS)
    plain = optax.adam(1e-2).init(PARAMS)
    save_orbax(tmp_path / "plain", plain)
    with pytest.raises(ValueError, match="holds no loss-scale state"):
        lsj.restore_orbax(tmp_path / "plain", target)
    with pytest.raises(ValueError, match="holds no loss-scale state"):
        lsj.restore_flax(target, serialization.to_bytes(plain))
    # The way out the message gives works: restore the inner state, wrap it.
    inner = ocp.StandardCheckpointer().restore(tmp_path / "plain", target.inner_state)
    migrated = target._replace(inner_state=inner)
    assert_bits_equal(migrated.inner_state, plain)


def test_loss_scaled_checkpoint_into_plain_optimizer_is_named(tmp_path):
    save_orbax(tmp_path / "ls", TXS["adam"]().init(PARAMS))
    with pytest.raises(ValueError, match="holds a loss-scale state .* has none"):
        lsj.restore_orbax(tmp_path / "ls", optax.adam(1e-2).init(PARAMS))


def test_other_mismatches_are_named(tmp_path):
    state = TXS["adam"]().init(PARAMS)
    # A loss-scale state from a version with other fields.
    sd = serialization.to_state_dict(state)
    del sd["loss_scale"]["stuck"]
    with pytest.raises(ValueError, match=r"missing fields \['stuck'\]"):
        lsj.restore_flax(state, sd)
    with pytest.raises(ValueError, match="does not match this version's fields"):
        serialization.from_state_dict(state, sd)
    # Another model's shapes.
    other = TXS["adam"]().init({"b": jnp.zeros(5), "w": jnp.zeros((4, 5))})
    save_orbax(tmp_path / "other", other)
    with pytest.raises(ValueError, match="leaf 'inner_state/0/mu/b' has shape \\(5,\\)"):
        lsj.restore_orbax(tmp_path / "other", state)
    # Another optimizer (sgd has no moments).
    with pytest.raises(ValueError, match="does not match the optimizer state's structure"):
        lsj.check_checkpoint(state, lsj.loss_scaling(optax.sgd(0.1), POLICY).init(PARAMS))
    with pytest.raises(TypeError, match="encoded"):
        lsj.restore_flax(state, "not bytes")


def test_a_checkpoint_saved_under_another_policy_is_reported(tmp_path):
    """The issue's case: overflows, so the user lowers the scale and resumes the checkpoint."""
    saved = lsj.loss_scaling(optax.adam(1e-2), lsj.DynamicScale(init_scale=2.0**15)).init(PARAMS)
    save_orbax(tmp_path / "ck", saved)
    lower = lsj.StaticScale(8.0)
    target = lsj.loss_scaling(optax.adam(1e-2), lower).init(PARAMS)
    message = r"has scale 32768\.0, which StaticScale\(scale=8\.0.*switch_policy"
    with pytest.raises(ValueError, match=message):
        lsj.restore_orbax(tmp_path / "ck", target, policy=lower)
    with pytest.raises(ValueError, match=message):
        lsj.restore_flax(target, serialization.to_bytes(saved), policy=lower)
    with pytest.raises(ValueError, match=message):
        lsj.check_checkpoint(target, serialization.to_state_dict(saved), policy=lower)
    with pytest.raises(ValueError, match=message):
        lsj.check_checkpoint(target, saved, policy=lower)
    # Outside a dynamic policy's bounds: reported too.
    capped = lsj.DynamicScale(init_scale=16.0, max_scale=16.0)
    with pytest.raises(ValueError, match="would not hold \\(it keeps 16.0\\)"):
        lsj.restore_flax(target, serialization.to_bytes(saved), policy=capped)
    # An Orbax metadata tree has no values to check.
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(tmp_path / "ck")
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
    with pytest.raises(TypeError, match="needs the checkpoint's values"):
        lsj.check_checkpoint(target, tree, policy=lower)
    # The fix the message names: restore as saved, then switch; the counters are kept.
    restored = lsj.switch_policy(lsj.restore_orbax(tmp_path / "ck", target), lower)
    assert float(lsj.scale_loss(jnp.float32(1.0), restored)) == 8.0
    # A checkpoint the policy would hold passes.
    same = lsj.DynamicScale(init_scale=2.0**15)
    lsj.restore_orbax(tmp_path / "ck", target, policy=same)
    lsj.restore_flax(target, serialization.to_bytes(saved), policy=same)
    lsj.check_checkpoint(target, serialization.to_state_dict(saved), policy=same)


def test_a_checkpoint_of_another_front_end_is_named_and_the_way_out_works():
    params = {"w": jnp.ones(3)}
    plain = lsj.loss_scaling(optax.adam(0.1), lsj.DynamicScale(init_scale=8.0))
    multi = lsj.loss_scaling_multi_steps(optax.adam(0.1), lsj.DynamicScale(init_scale=8.0), 2)
    state = plain.init(params)
    _, state = plain.update({"w": jnp.full(3, 8.0)}, state, params)
    encoded = serialization.to_bytes(state)
    with pytest.raises(lsj.errors.CheckpointError, match=r"loss_scaling_multi_steps\(\.\.\.\)'s"):
        lsj.restore_flax(multi.init(params), encoded)
    # What the message says to do: restore as saved, carry loss_scale and inner_state over.
    old = lsj.restore_flax(plain.init(params), encoded)
    moved = multi.init(params)._replace(loss_scale=old.loss_scale, inner_state=old.inner_state)
    assert_bits_equal(moved.inner_state, state.inner_state)
    for _ in range(2):  # one window: the moved Adam state takes its second step
        _, moved = multi.update({"w": jnp.full(3, 8.0)}, moved, params)
    assert int(moved.inner_state[0].count) == 2
    assert int(moved.loss_scale.total_steps) == 2


# A policy with state of its own: fairseq's scaler with tolerance > 0 keeps two counters in
# LossScaleState.policy_state. By hand, with overflows at 1, 2, 7, 8, 9 (o overflows since
# the last backoff, r iterations since the last rescale, this one counted):
#   1: o/r = 1/2 < 0.6, tolerated (256)   2: 2/3 >= 0.6, backoff (128)   5: growth (256)
#   7: 1/2 tolerated (256)   8: 2/3 backoff (128)   9: 1/1 backoff (64)   12: growth (128)
# With tolerance=0 every overflow backs off: 128, 64, 128 at 5, then 64, 32, 16, 32 at 12.
FAIRSEQ_TOLERANT = lsj.compat.fairseq.DynamicLossScaler(
    init_scale=2.0**8, scale_window=3, tolerance=0.6
)


@pytest.mark.slow  # about 4 s: an Orbax save and restore
def test_a_policys_own_state_is_checkpointed_and_resumes_bit_for_bit(tmp_path):
    tx = lsj.loss_scaling(optax.adam(1e-2), FAIRSEQ_TOLERANT)
    step, traces = make_step(tx)
    start = (PARAMS, tx.init(PARAMS))
    full = run(step, *start, 0, N_STEPS)
    save_at = 8  # after the tolerated overflow at 7
    saved = run(step, *start, 0, save_at)
    own = saved[1].loss_scale.policy_state
    assert {k: int(v) for k, v in own.items()} == {
        "iter_since_rescale": 3,  # the growth at 5, then 6 and 7
        "overflows_since_rescale": 1,  # the overflow at 7
    }
    save_orbax(tmp_path / "ck", saved)
    for restored in (
        lsj.restore_orbax(tmp_path / "ck", start, policy=FAIRSEQ_TOLERANT),
        lsj.restore_flax(start, serialization.to_bytes(saved), policy=FAIRSEQ_TOLERANT),
    ):
        assert_bits_equal(restored, saved)
        assert_bits_equal(run(step, *restored, save_at, N_STEPS), full)
    assert len(traces) == 1
    assert float(full[1].loss_scale.scale) == 128.0
    assert int(full[1].loss_scale.skipped_steps) == 5
    strict_policy = lsj.compat.fairseq.DynamicLossScaler(init_scale=2.0**8, scale_window=3)
    strict = lsj.loss_scaling(optax.adam(1e-2), strict_policy)
    step0, _ = make_step(strict)
    assert float(run(step0, PARAMS, strict.init(PARAMS), 0, N_STEPS)[1].loss_scale.scale) == 32.0


def test_a_policys_own_state_mismatch_is_named(tmp_path):
    tolerant = lsj.loss_scaling(optax.adam(1e-2), FAIRSEQ_TOLERANT).init(PARAMS)
    strict_policy = lsj.compat.fairseq.DynamicLossScaler(init_scale=2.0**8, scale_window=3)
    strict = lsj.loss_scaling(optax.adam(1e-2), strict_policy).init(PARAMS)
    message = r"holds a policy_state of .*iter_since_rescale int32.*keeps none.*switch_policy"
    with pytest.raises(lsj.errors.CheckpointPolicyError, match=message):
        lsj.restore_flax(strict, serialization.to_bytes(tolerant))
    with pytest.raises(lsj.errors.CheckpointPolicyError, match="holds a policy_state of none"):
        lsj.check_checkpoint(tolerant, strict)
    # flax.serialization alone (no check first) refuses it too, naming the field.
    with pytest.raises(ValueError, match="keeps its own policy_state.*keeps none"):
        serialization.from_bytes(strict, serialization.to_bytes(tolerant))
    # The way out the message names: restore as saved, then switch; fresh counters.
    restored = lsj.switch_policy(
        lsj.restore_flax(strict, serialization.to_bytes(strict)), FAIRSEQ_TOLERANT
    )
    assert_bits_equal(restored, tolerant)


def test_a_checkpoint_from_before_policy_state_restores():
    """A flax state dict saved before the field existed lacks the key: it restores into a
    target whose policy keeps no state of its own."""
    state = TXS["adam"]().init(PARAMS)
    sd = serialization.to_state_dict(state)
    del sd["loss_scale"]["policy_state"]
    back = lsj.restore_flax(state, serialization.msgpack_serialize(sd))
    assert_bits_equal(back, state)
    target = lsj.loss_scaling(optax.adam(1e-2), FAIRSEQ_TOLERANT).init(PARAMS)
    with pytest.raises(ValueError, match="policy_state"):
        lsj.restore_flax(target, serialization.msgpack_serialize(sd))


@pytest.mark.slow  # about 2 s: an Orbax save and restore
def test_an_orbax_checkpoint_from_before_policy_state_restores(tmp_path):
    """Orbax compares trees node by node, and such a checkpoint has no policy_state node."""
    import chex

    @chex.dataclass
    class LossScaleState:  # the state as the release before policy_state saved it
        scale: jax.Array
        growth_count: jax.Array
        hysteresis_count: jax.Array
        last_overflow: jax.Array
        last_skipped: jax.Array
        stuck: jax.Array
        total_steps: jax.Array
        overflow_steps: jax.Array
        skipped_steps: jax.Array
        recent_overflow_rate: jax.Array
        range_peak: jax.Array
        margin: jax.Array

    tx = TXS["chain"]()
    step, _ = make_step(tx)
    params, state = run(step, PARAMS, tx.init(PARAMS), 0, SAVE_AT)
    own = dict(state[0].loss_scale.items())
    assert own.pop("policy_state") is None
    old = (state[0]._replace(loss_scale=LossScaleState(**own)),)
    save_orbax(tmp_path / "old", old)
    restored = lsj.restore_orbax(tmp_path / "old", tx.init(PARAMS), policy=POLICY)
    assert_bits_equal(restored, state)
