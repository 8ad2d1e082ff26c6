"""Bringing a run across: ``compat.<framework>.import_state``/``export_state`` round trips.

Each framework's saved scaler state is imported at several points of a run, the run is continued
here, and every later step must equal the original's: the scale, the counters and (exported
back) the original's own saved values. The originals:

- torch: ``tests/fixtures/torch_grad_scaler.json``, ``GradScaler.state_dict()`` recorded from
  real torch 2.13.0 runs (``tests/fixtures/make_torch_grad_scaler.py``).
- DeepSpeed: ``tests/fixtures/deepspeed_loss_scaler.json``, the attributes of DeepSpeed's own
  ``DynamicLossScaler`` (what ZeRO pickles) and the ``state_dict()`` entries of its fp16
  optimizers, recorded by running DeepSpeed's source (its ``made_by`` says how).
- Megatron: ``DynamicGradScaler.update``/``state_dict`` transcribed in ``reference_scalers.py``.
- Keras 3, Flax, jmp: the real objects (test dependencies).
"""

from __future__ import annotations

import functools
import json
import os
import pathlib

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jmp as real_jmp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from flax import serialization  # noqa: E402
from flax.training import dynamic_scale as flax_dynamic_scale  # noqa: E402
from reference_scalers import (  # noqa: E402
    DeepSpeedDynamicLossScaler,
    DeepSpeedFP16Optimizer,
    MegatronDynamicGradScaler,
)

import lossscale_jax as lsj  # noqa: E402
from lossscale_jax import compat  # noqa: E402

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@functools.cache
def _adjust(policy):
    return jax.jit(policy.adjust)


def _continue(policy, state, flags):
    """The states after each of ``flags`` (True = overflow), starting from ``state``."""
    out = []
    for f in flags:
        state = _adjust(policy)(state, jnp.asarray(bool(f)))
        out.append(state)
    return out


def _load(name):
    return json.loads((FIXTURES / name).read_text())


def _flags(overflow):
    return [c == "1" for c in overflow] if isinstance(overflow, str) else list(overflow)


def _rows(table):
    return [dict(zip(table["keys"], row, strict=True)) for row in table["rows"]]


# --------------------------------------------------------------------------
# torch GradScaler (real torch's state dicts).

TORCH = _load("torch_grad_scaler.json")


@pytest.mark.parametrize("run", range(len(TORCH["runs"])))
def test_torch_state_dict_round_trip(run):
    r = TORCH["runs"][run]
    flags, saved = _flags(r["overflow"]), r["state_dicts"]
    for k in [0, 7, 16, len(flags) - 3]:
        policy, state = compat.torch.import_state(saved[k])
        assert compat.torch.export_state(policy, state) == saved[k]
        for j, s in enumerate(_continue(policy, state, flags[k:])):
            assert compat.torch.export_state(policy, s) == saved[k + 1 + j], (run, k, j)
            assert bool(s.last_skipped) == flags[k + j]


def test_torch_resume_with_set_loss_scale_state_continues_torch():
    # A whole optimizer: import at step 9, train on, compare the scale with torch's.
    r = TORCH["runs"][0]
    flags, saved = _flags(r["overflow"]), r["state_dicts"]
    policy, state = compat.torch.import_state(saved[9])
    params = {"w": jnp.zeros(3, jnp.float32)}
    tx = lsj.loss_scaling(optax.sgd(0.1), policy)
    opt_state = lsj.set_loss_scale_state(tx.init(params), state)
    update = jax.jit(tx.update)
    for i, f in enumerate(flags[9:]):
        g = jnp.array([jnp.inf if f else 1.0, 1.0, 1.0], jnp.float16)
        _, opt_state = update({"w": g}, opt_state, params)
        ls = lsj.get_loss_scale_state(opt_state)
        assert compat.torch.export_state(policy, ls) == saved[10 + i]


def test_torch_disabled_scaler():
    assert compat.torch.export_state(lsj.NoScale(), lsj.NoScale().init()) == {}
    with pytest.raises(ValueError, match="disabled instance of GradScaler"):
        compat.torch.import_state({})


def test_torch_hyperparameters_come_with_the_state_dict():
    # torch's load_state_dict restores the factors and interval; import_state's policy carries
    # them. A state put into an optimizer built with another policy runs with that policy's.
    saved = {
        "scale": 256.0,
        "growth_factor": 4.0,
        "backoff_factor": 0.25,
        "growth_interval": 3,
        "_growth_tracker": 2,
    }
    policy, state = compat.torch.import_state(saved)
    assert float(_continue(policy, state, [False])[0].scale) == 1024.0  # 256 * 4
    other = compat.torch.GradScaler(init_scale=256.0, growth_interval=2000)
    assert float(_continue(other, state, [False])[0].scale) == 256.0  # 3 good steps of 2000


# --------------------------------------------------------------------------
# DeepSpeed (DeepSpeed's own code's saved values).

DEEPSPEED = _load("deepspeed_loss_scaler.json")


def _zero_reference(attrs):
    """DeepSpeed's DynamicLossScaler (transcribed) holding ``attrs``."""
    ref = DeepSpeedDynamicLossScaler(
        init_scale=attrs["cur_scale"],
        scale_factor=attrs["scale_factor"],
        scale_window=attrs["scale_window"],
        min_scale=attrs["min_scale"],
        delayed_shift=attrs["delayed_shift"],
        consecutive_hysteresis=attrs["consecutive_hysteresis"],
        raise_error_at_min_scale=attrs["raise_error_at_min_scale"],
    )
    for key in ("cur_iter", "last_overflow_iter", "cur_hysteresis"):
        setattr(ref, key, attrs[key])
    return ref


@pytest.mark.parametrize("run", range(len(DEEPSPEED["zero"])))
def test_deepspeed_zero_loss_scaler_round_trip(run):
    r = DEEPSPEED["zero"][run]
    flags, saved = _flags(r["overflow"]), _rows(r["loss_scaler_vars"])
    for k in [0, 2, 11, 20, 33]:
        policy, state = compat.deepspeed.import_state(saved[k])
        states = _continue(policy, state, flags[k:])
        for j, s in enumerate(states):
            want = saved[k + 1 + j]
            got = compat.deepspeed.export_state(
                policy, s, raise_error_at_min_scale=want["raise_error_at_min_scale"]
            )
            assert got["cur_scale"] == want["cur_scale"], (run, k, j)
            assert got["cur_hysteresis"] == want["cur_hysteresis"], (run, k, j)
            good = want["cur_iter"] - want["last_overflow_iter"] - 1
            assert got["cur_iter"] - got["last_overflow_iter"] - 1 == good % want["scale_window"]
            for key in ("scale_factor", "scale_window", "min_scale", "delayed_shift"):
                assert got[key] == want[key]
            assert got["consecutive_hysteresis"] == want["consecutive_hysteresis"]
        # Exported mid-run, DeepSpeed's rule carries on exactly as the original did.
        mid = compat.deepspeed.export_state(
            policy, states[3], raise_error_at_min_scale=saved[k]["raise_error_at_min_scale"]
        )
        ref = _zero_reference(mid)
        for j, f in enumerate(flags[k + 4 :]):
            assert ref.step(f)[0] == saved[k + 5 + j]["cur_scale"], (run, k, j)


def test_deepspeed_static_loss_scaler():
    saved = DEEPSPEED["static_loss_scaler_vars"]
    policy, state = compat.deepspeed.import_state(saved)
    assert policy == lsj.StaticScale(128.0) and float(state.scale) == 128.0
    assert compat.deepspeed.export_state(policy, state) == {"cur_scale": 128.0, "dynamic": False}


@pytest.mark.parametrize("run", range(len(DEEPSPEED["fp16_optimizer"])))
def test_deepspeed_fp16_optimizer_state_dict_round_trip(run):
    r = DEEPSPEED["fp16_optimizer"][run]
    flags, saved = _flags(r["overflow"]), _rows(r["state_dicts"])
    args = r["dynamic_loss_args"]
    for k in [0, 3, 9, 25]:
        policy, state = compat.deepspeed.import_fp16_optimizer_state(
            saved[k], min_loss_scale=args["min_scale"]
        )
        assert policy == compat.deepspeed.fp16_optimizer_policy(
            dynamic_loss_scale=True, dynamic_loss_args={**args, "init_scale": saved[k]["cur_scale"]}
        )
        states = _continue(policy, state, flags[k:])
        for j, s in enumerate(states):
            want = saved[k + 1 + j]
            got = compat.deepspeed.export_fp16_optimizer_state(policy, s)
            assert got["cur_scale"] == want["cur_scale"], (run, k, j)
            assert got["scale_factor"] == want["scale_factor"]
            assert got["scale_window"] == want["scale_window"]
        # Exported, then continued by DeepSpeed's own rule: the original's scales.
        mid = compat.deepspeed.export_fp16_optimizer_state(policy, states[2])
        ref = DeepSpeedFP16Optimizer(mid["cur_scale"], mid["scale_window"], args["min_scale"])
        ref.cur_iter, ref.last_overflow_iter = mid["cur_iter"], mid["last_overflow_iter"]
        for j, f in enumerate(flags[k + 3 :]):
            assert ref.step(f)[0] == saved[k + 4 + j]["cur_scale"], (run, k, j)


# --------------------------------------------------------------------------
# Megatron (DynamicGradScaler transcribed with its state_dict).

MEGATRON = dict(
    min_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=4, hysteresis=3
)
SEQ = [bool(int(c)) for c in "0011101000001111000010100000000110000000"]


def test_megatron_state_dict_round_trip():
    for k in [0, 5, 14, 22]:
        ref = MegatronDynamicGradScaler(2.0**16, **MEGATRON)
        for f in SEQ[:k]:
            ref.step(f)
        policy, state = compat.megatron.import_state(ref.state_dict(), **MEGATRON)
        for j, s in enumerate(_continue(policy, state, SEQ[k:])):
            scale, _ = ref.step(SEQ[k + j])
            got = compat.megatron.export_state(policy, s)
            want = ref.state_dict()
            np.testing.assert_array_equal(got["scale"], want["scale"])
            assert got["growth_tracker"] == want["growth_tracker"]
            # A tracker Megatron drove below 1 is exported as 0: both back off on every overflow.
            assert got["hysteresis_tracker"] == max(want["hysteresis_tracker"], 0), (k, j)
            assert float(s.scale) == float(scale)


def test_megatron_constant_scaler_saves_nothing():
    with pytest.raises(ValueError, match="ConstantGradScaler saves no state"):
        compat.megatron.import_state({}, **MEGATRON)


# --------------------------------------------------------------------------
# Keras 3 (the real LossScaleOptimizer, JAX backend).


@functools.cache
def _keras():
    keras = pytest.importorskip("keras")
    assert keras.backend.backend() == "jax"
    opt = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=2.0**10, dynamic_growth_steps=3
    )
    var = keras.Variable(np.zeros((), np.float32))
    opt.build([var])
    paths = [v.path for v in opt.variables]

    @jax.jit
    def step(opt_vars, tv, f):
        grad = jnp.where(f, jnp.inf, 1.0).astype(jnp.float32)
        return opt.stateless_apply(opt_vars, [grad], tv)

    return opt, var, paths, step


def _keras_run(opt_vars, flags):
    opt, var, paths, step = _keras()
    tv, out = [var.value], []
    for f in flags:
        tv, opt_vars = step(opt_vars, tv, jnp.asarray(f))
        out.append({p: np.asarray(v) for p, v in zip(paths, opt_vars, strict=True)})
    return out


@pytest.mark.slow
def test_keras_variables_round_trip():
    opt, _, paths, _ = _keras()
    # Keras numbers its optimizers' names (loss_scale_optimizer_1/...) within a process.
    (scale_key,) = [p for p in paths if p.endswith("/dynamic_scale")]
    (counter_key,) = [p for p in paths if p.endswith("/step_counter")]
    start = [v.value for v in opt.variables]
    keras_steps = _keras_run(start, SEQ)
    for k in [4, 13, 30]:
        policy, state = compat.keras.import_state(keras_steps[k - 1], dynamic_growth_steps=3)
        for j, s in enumerate(_continue(policy, state, SEQ[k:])):
            want = keras_steps[k + j]
            got = compat.keras.export_state(policy, s)
            assert float(got["dynamic_scale"]) == float(want[scale_key])
            assert int(got["step_counter"]) == int(want[counter_key])
    # Exported into Keras's variables mid-run, Keras continues exactly as this library does.
    policy = compat.keras.policy(2.0**10, 3)
    ours = _continue(policy, policy.init(), SEQ)
    saved = compat.keras.export_state(policy, ours[11])
    values = list(start)
    values[paths.index(scale_key)] = jnp.asarray(saved["dynamic_scale"])
    values[paths.index(counter_key)] = jnp.asarray(saved["step_counter"])
    for j, want in enumerate(_keras_run(values, SEQ[12:])):
        assert float(want[scale_key]) == float(ours[12 + j].scale)


# --------------------------------------------------------------------------
# Flax (the real DynamicScale).


@functools.cache
def _flax_step():
    @jax.jit
    def step(ds, f):
        new_ds, _, _, _ = ds.value_and_grad(lambda p: jnp.where(f, jnp.inf, 1.0) * p)(1.0)
        return new_ds

    return step


def test_flax_dynamic_scale_round_trip():
    ds = flax_dynamic_scale.DynamicScale(growth_interval=3, scale=2.0**10)
    flax_steps = []
    for f in SEQ:
        ds = _flax_step()(ds, jnp.asarray(f))
        flax_steps.append(ds)
    for k in [4, 13, 30]:
        saved = flax_steps[k - 1]
        policy, state = compat.flax.import_state(saved)
        # The checkpointed fields (flax.serialization) plus the hyperparameters: the same.
        from_dict = compat.flax.import_state(
            {**serialization.to_state_dict(saved), "growth_interval": 3}
        )
        assert from_dict[0] == policy
        for j, s in enumerate(_continue(policy, state, SEQ[k:])):
            got = compat.flax.export_state(policy, s)
            assert float(got["scale"]) == float(flax_steps[k + j].scale)
            assert int(got["fin_steps"]) == int(flax_steps[k + j].fin_steps)
    # Exported into a Flax DynamicScale mid-run, Flax continues as this library does.
    policy = compat.flax.dynamic_scale_policy(growth_interval=3, scale=2.0**10)
    ours = _continue(policy, policy.init(), SEQ)
    ds = flax_dynamic_scale.DynamicScale(**compat.flax.export_state(policy, ours[11]))
    for j, f in enumerate(SEQ[12:]):
        ds = _flax_step()(ds, jnp.asarray(f))
        assert float(ds.scale) == float(ours[12 + j].scale)


# --------------------------------------------------------------------------
# jmp (the real DynamicLossScale).


@functools.cache
def _jmp_step():
    @functools.partial(jax.jit, static_argnums=(2, 3))
    def step(loss_scale, counter, period, factor, min_loss_scale, f):
        ls = real_jmp.DynamicLossScale(loss_scale, counter, period, factor, min_loss_scale)
        new = ls.adjust(jnp.logical_not(f))
        return new.loss_scale, new.counter

    return step


def _jmp_run(ls, flags):
    out = []
    for f in flags:
        loss_scale, counter = _jmp_step()(
            ls.loss_scale, ls.counter, ls.period, ls.factor, ls.min_loss_scale, jnp.asarray(f)
        )
        ls = real_jmp.DynamicLossScale(loss_scale, counter, ls.period, ls.factor, ls.min_loss_scale)
        out.append(ls)
    return out


def test_jmp_dynamic_loss_scale_round_trip():
    start = real_jmp.DynamicLossScale(jnp.float32(2.0**10), jnp.int32(0), 3, 2, jnp.float32(4.0))
    jmp_steps = _jmp_run(start, SEQ)
    for k in [4, 13, 30]:
        policy, state = compat.jmp.import_state(jmp_steps[k - 1])
        assert policy.min_scale == 4.0
        for j, s in enumerate(_continue(policy, state, SEQ[k:])):
            got = compat.jmp.export_state(policy, s)
            assert float(got["loss_scale"]) == float(jmp_steps[k + j].loss_scale)
            assert int(got["counter"]) == int(jmp_steps[k + j].counter)
    policy = compat.jmp.dynamic_loss_scale_policy(jnp.float32(2.0**10), 0, 3, 2, 4.0)
    ours = _continue(policy, policy.init(), SEQ)
    ls = real_jmp.DynamicLossScale(**compat.jmp.export_state(policy, ours[11]))
    for j, want in enumerate(_jmp_run(ls, SEQ[12:])):
        assert float(want.loss_scale) == float(ours[12 + j].scale)


def test_jmp_static_and_no_op():
    policy, state = compat.jmp.import_state(real_jmp.StaticLossScale(jnp.float32(128.0)))
    assert policy == lsj.StaticScale(128.0)
    assert compat.jmp.export_state(policy, state) == {"loss_scale": np.float32(128.0)}
    policy, _ = compat.jmp.import_state(real_jmp.NoOpLossScale())
    assert policy == lsj.NoScale()


# --------------------------------------------------------------------------
# set_loss_scale_state and the checks on what is imported.


def test_set_loss_scale_state_nested_and_checked():
    params = {"w": jnp.zeros(2, jnp.float32)}
    policy, state = compat.torch.import_state(TORCH["runs"][0]["state_dicts"][5])
    tx = optax.chain(lsj.loss_scaling(optax.chain(optax.clip(1.0), optax.sgd(0.1)), policy))
    opt_state = lsj.set_loss_scale_state(tx.init(params), state)
    assert float(lsj.get_loss_scale_state(opt_state).scale) == float(state.scale)
    assert jax.tree_util.tree_structure(opt_state) == jax.tree_util.tree_structure(tx.init(params))
    with pytest.raises(ValueError, match="opt_state contains no LossScaleState"):
        lsj.set_loss_scale_state(optax.sgd(0.1).init(params), state)
    with pytest.raises(ValueError, match="does not match the optimizer state's LossScaleState"):
        lsj.set_loss_scale_state(opt_state, state.replace(scale=jnp.float16(2.0)))
    with pytest.raises(TypeError, match="loss_scale_state must be a LossScaleState"):
        lsj.set_loss_scale_state(opt_state, {"scale": 2.0})


def test_imported_states_are_built_from_init():
    # Every field the import does not set keeps init()'s value (and dtype): telemetry starts
    # at zero, and fields a later version adds get their initial values.
    policy, state = compat.torch.import_state(TORCH["runs"][0]["state_dicts"][12])
    fresh = policy.init()
    for name in ("total_steps", "overflow_steps", "skipped_steps", "last_overflow", "stuck"):
        np.testing.assert_array_equal(getattr(state, name), getattr(fresh, name))
    for a, b in zip(
        jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(fresh), strict=True
    ):
        assert a.dtype == b.dtype and a.shape == b.shape


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (
            lambda: compat.torch.import_state({"scale": 1.0}),
            ValueError,
            "has no 'growth_interval' entry",
        ),
        (
            lambda: compat.torch.import_state({**TORCH["runs"][0]["state_dicts"][0], "scale": 0.0}),
            ValueError,
            "scale must be a finite number > 0",
        ),
        (
            lambda: compat.torch.import_state(
                {**TORCH["runs"][0]["state_dicts"][0], "_growth_tracker": 5}
            ),
            ValueError,
            r"_growth_tracker must be in \[0, 4\]",
        ),
        (
            lambda: compat.torch.export_state(
                lsj.DynamicScale(hysteresis=2), lsj.DynamicScale().init()
            ),
            ValueError,
            "has no torch equivalent",
        ),
        (
            lambda: compat.torch.export_state(compat.torch.GradScaler(), {"scale": 1.0}),
            TypeError,
            "state must be a LossScaleState",
        ),
        (
            lambda: compat.keras.import_state({"dynamic_scale": 2.0}),
            ValueError,
            "exactly one 'step_counter'",
        ),
        (
            lambda: compat.deepspeed.import_state(
                {**_rows(DEEPSPEED["zero"][0]["loss_scaler_vars"])[3], "cur_hysteresis": 0}
            ),
            ValueError,
            r"cur_hysteresis must be in \[1, 2\]",
        ),
        (
            lambda: compat.deepspeed.export_fp16_optimizer_state(
                compat.deepspeed.DynamicLossScaler(), compat.deepspeed.DynamicLossScaler().init()
            ),
            ValueError,
            "has no FP16_Optimizer equivalent",
        ),
    ],
)
def test_import_and_export_reject_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
