"""Every user mistake in docs/errors.md gets the error the table promises (and the table lists
every case here)."""

from __future__ import annotations

import re
import sys
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization
from helpers import ROOT, replicate  # tests/ is on sys.path under pytest

import lossscale_jax as lsj
from lossscale_jax import compat

DOC = ROOT / "docs" / "errors.md"
PARAMS = {"w": jnp.ones(3, jnp.float32)}
TX = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale())
STATE = TX.init(PARAMS)
G16 = {"w": jnp.ones(3, jnp.float16)}


def loss16(params, x):
    """A float16 loss (float32 weights) for diagnose's cases."""
    return jnp.sum((x @ params["w"].astype(jnp.float16)).astype(jnp.float32))


X16 = jnp.ones((1, 3), jnp.float16)


def diagnose(loss_fn=loss16, params=PARAMS, batches=(X16,), **kw):
    return lsj.diagnose(loss_fn, params, batches, print_table=False, **kw)


def bitcast_loss(params, x):
    w = params["w"].astype(jnp.float16)
    bits = jax.lax.bitcast_convert_type(w, jnp.int16)
    return jnp.sum(w.astype(jnp.float32)) + jnp.sum(bits).astype(jnp.float32) * 0.0


def plot_without_matplotlib():
    report = diagnose(scales=[1.0])
    with mock.patch.dict(sys.modules, {"matplotlib": None, "matplotlib.figure": None}):
        report.plot()


def two_loss_scalings():
    tx = optax.chain(
        lsj.loss_scaling(optax.sgd(0.1), lsj.StaticScale(2.0)),
        lsj.loss_scaling(optax.sgd(0.1), lsj.StaticScale(4.0)),
    )
    lsj.scale_loss(jnp.float32(1.0), tx.init(PARAMS))


def unbound_axis():
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(), axis_name="batch")
    jax.jit(tx.update)(G16, tx.init(PARAMS), PARAMS)


def checkpoint_without_loss_scaling():
    lsj.check_checkpoint(STATE, optax.sgd(0.1).init(PARAMS))


def read(tx):
    """What scale_loss, metrics and TrainState.create do first: read the loss-scale state."""
    return lambda: lsj.scale_loss(jnp.float32(1.0), tx.init(PARAMS))


def _ls():
    return lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale())


def under_pmap(tx, grads_fn=lambda g: g):
    """tx.update under jax.pmap over "batch" (8 devices), on each device's gradients; the
    devices are asked for when the case runs (a multidevice case: MULTIDEVICE)."""

    def step(p, s, g):
        return tx.update(grads_fn(g), s, p)[1]

    def call():
        args = replicate((PARAMS, tx.init(PARAMS), G16), 8)
        return jax.pmap(step, axis_name="batch")(*args)

    return call


def under_shard_map(tx, average_first=False):
    """tx.update under shard_map over an 8-device "batch" mesh, made when the case runs."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def body(p, s, g):
        g = jax.tree_util.tree_map(lambda a: a[0], g)
        if average_first:
            g = jax.lax.pmean(g, "batch")
        return tx.update(g, s, p)[1].loss_scale.scale

    def call():
        mesh = jax.make_mesh((8,), ("batch",), devices=jax.devices()[:8])
        g = jax.device_put(replicate(G16, 8), NamedSharding(mesh, P("batch")))
        sm = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("batch")), out_specs=P())
        return jax.jit(sm)(PARAMS, tx.init(PARAMS), g)

    return call


def restore_under_another_policy():
    saved = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=2.0**15)).init(PARAMS)
    lsj.restore_flax(STATE, serialization.to_bytes(saved), policy=lsj.StaticScale(8.0))


def restore_another_front_end():
    saved = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale()).init(PARAMS)
    target = lsj.loss_scaling_multi_steps(optax.sgd(0.1), lsj.DynamicScale(), 2).init(PARAMS)
    lsj.restore_flax(target, serialization.to_bytes(saved))


def restore_without_the_policys_own_state():
    tolerant = lsj.compat.fairseq.DynamicLossScaler(tolerance=0.25)
    saved = lsj.loss_scaling(optax.sgd(0.1), tolerant).init(PARAMS)
    lsj.restore_flax(STATE, serialization.to_bytes(saved))


def policy_without_conform():
    class Mine(lsj.LossScalePolicy):
        def init(self):
            return lsj.StaticScale(2.0).init()

        def adjust(self, state, overflow, amax=None):
            return lsj.StaticScale(2.0).adjust(state, overflow)

    lsj.switch_policy(STATE, Mine())


def policy_without_adjust():
    class Mine(lsj.LossScalePolicy):
        def init(self):
            return lsj.StaticScale(2.0).init()

    Mine()


# (mistake, call, exception, message excerpt as it appears in docs/errors.md)
CASES = [
    (
        "HeadroomScale min_margin",
        lambda: lsj.HeadroomScale(min_margin=-1),
        ValueError,
        "min_margin must be an int in [0,",
    ),
    (
        "HeadroomScale max_margin below min_margin",
        lambda: lsj.HeadroomScale(min_margin=2, max_margin=1),
        ValueError,
        "max_margin (1) must be >= min_margin (2)",
    ),
    (
        "HeadroomScale max_margin",
        lambda: lsj.HeadroomScale(max_margin=65),
        ValueError,
        "max_margin must be an int in [min_margin, 64]",
    ),
    (
        "HeadroomScale window",
        lambda: lsj.HeadroomScale(window=0),
        ValueError,
        "window must be an int in [1,",
    ),
    (
        "HeadroomScale blind_backoff",
        lambda: lsj.HeadroomScale(blind_backoff=1.0),
        ValueError,
        "blind_backoff must be in (0, 1)",
    ),
    (
        "HeadroomScale.adjust without amax",
        lambda: lsj.HeadroomScale().adjust(lsj.HeadroomScale().init(), False),
        TypeError,
        "HeadroomScale.adjust needs amax=",
    ),
    (
        "HeadroomScale.adjust amax not a scalar",
        lambda: lsj.HeadroomScale().adjust(lsj.HeadroomScale().init(), False, amax=jnp.ones(2)),
        ValueError,
        "amax must be a scalar",
    ),
    (
        "backoff_factor",
        lambda: lsj.DynamicScale(backoff_factor=2.0),
        ValueError,
        "backoff_factor must be in (0, 1)",
    ),
    (
        "growth_factor",
        lambda: lsj.DynamicScale(growth_factor=1.0),
        ValueError,
        "growth_factor must be a finite number > 1",
    ),
    (
        "growth_interval",
        lambda: lsj.DynamicScale(growth_interval=1.5),
        TypeError,
        "growth_interval must be an int",
    ),
    (
        "hysteresis",
        lambda: lsj.DynamicScale(hysteresis=0),
        ValueError,
        "hysteresis must be an int in [1,",
    ),
    (
        "init_scale",
        lambda: lsj.DynamicScale(init_scale=float("inf")),
        ValueError,
        "init_scale must be a finite number > 0",
    ),
    (
        "init_scale range",
        lambda: lsj.DynamicScale(init_scale=0.5, min_scale=1.0),
        ValueError,
        "init_scale must be in [min_scale, max_scale]",
    ),
    (
        "min>max",
        lambda: lsj.DynamicScale(min_scale=4.0, max_scale=2.0, init_scale=4.0),
        ValueError,
        "must not exceed max_scale",
    ),
    ("bool as number", lambda: lsj.StaticScale(True), TypeError, "scale must be a real number"),
    ("static 0", lambda: lsj.StaticScale(0.0), ValueError, "scale must be a finite number > 0"),
    (
        "skip flag",
        lambda: lsj.NoScale(skip_on_overflow="yes"),
        TypeError,
        "skip_on_overflow must be a bool",
    ),
    (
        "policy",
        lambda: lsj.loss_scaling(optax.sgd(0.1), 2.0**15),
        TypeError,
        "policy must be a lossscale_jax policy",
    ),
    (
        "inner",
        lambda: lsj.loss_scaling("adam", lsj.DynamicScale()),
        TypeError,
        "inner must be an optax.GradientTransformation",
    ),
    (
        "overflow",
        lambda: lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(), overflow="inf"),
        ValueError,
        "overflow must be one of",
    ),
    (
        "compute_dtype",
        lambda: lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(), compute_dtype=jnp.int32),
        TypeError,
        "compute_dtype must be a floating dtype",
    ),
    (
        "axis_name ()",
        lambda: lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(), axis_name=()),
        ValueError,
        "axis_name must be a name or a non-empty tuple",
    ),
    (
        "on_stuck",
        lambda: lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(), on_stuck="raise"),
        ValueError,
        "on_stuck must be one of",
    ),
    (
        "every_k",
        lambda: lsj.loss_scaling_multi_steps(optax.sgd(0.1), lsj.DynamicScale(), 0),
        ValueError,
        "every_k must be an int in [1,",
    ),
    (
        "vector loss",
        lambda: lsj.scale_loss(jnp.ones(4), STATE),
        ValueError,
        "loss must be a scalar",
    ),
    (
        "integer loss",
        lambda: lsj.scale_loss(jnp.int32(3), STATE),
        TypeError,
        "loss must be a floating scalar",
    ),
    (
        "no loss-scale state",
        lambda: lsj.scale_loss(jnp.float32(1.0), optax.sgd(0.1).init(PARAMS)),
        ValueError,
        "opt_state contains no LossScaleState",
    ),
    (
        "metrics no state",
        lambda: lsj.metrics(optax.adam(0.1).init(PARAMS)),
        ValueError,
        "opt_state contains no LossScaleState",
    ),
    ("two states", two_loss_scalings, ValueError, "opt_state contains 2 LossScaleStates"),
    (
        "update wrong state",
        lambda: TX.update(G16, optax.sgd(0.1).init(PARAMS), PARAMS),
        TypeError,
        "state must be the LossScalingState",
    ),
    ("unbound axis", unbound_axis, ValueError, "axis_name='batch' is not bound here"),
    (
        "float8",
        lambda: TX.update({"w": jnp.ones(3, jnp.float8_e4m3fn)}, STATE, PARAMS),
        TypeError,
        "float8_e4m3fn are not supported",
    ),
    (
        "float8 check",
        lambda: lsj.check_overflow({"w": jnp.ones(3, jnp.float8_e5m2)}),
        TypeError,
        "float8_e5m2 are not supported",
    ),
    (
        "checkpoint",
        checkpoint_without_loss_scaling,
        ValueError,
        "The checkpoint holds no loss-scale state",
    ),
    (
        "checkpoint of another front-end",
        restore_another_front_end,
        ValueError,
        "The checkpoint holds the state of lossscale_jax.loss_scaling(...)",
    ),
    (
        "checkpoint with another policy's own state",
        restore_without_the_policys_own_state,
        lsj.errors.CheckpointPolicyError,
        "The checkpoint's loss-scale state at 'loss_scale' holds a policy_state of",
    ),
    # ---- issue: nothing bad reaches training in any composition ----
    (
        "compute_dtype float64",
        lambda: lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(), compute_dtype=float),
        ValueError,
        "compute_dtype must be one of ('float16', 'bfloat16', 'float32')",
    ),
    (
        "unscale scale 0",
        lambda: lsj.unscale_and_check(G16, 0.0),
        ValueError,
        "scale must be a finite number > 0, got 0.0: unscaling by it would return",
    ),
    (
        "unscale vector scale",
        lambda: lsj.unscale(G16, np.ones(2)),
        ValueError,
        "scale must be a scalar, got shape (2,)",
    ),
    (
        "traced hyperparameter",
        lambda: jax.jit(lambda s: lsj.StaticScale(s).init().scale)(jnp.float32(8.0)),
        TypeError,
        "scale must be a concrete number, got a traced value",
    ),
    (
        "loss_scaling(loss_scaling)",
        lambda: lsj.loss_scaling(_ls(), lsj.DynamicScale()),
        ValueError,
        "inner is itself lossscale_jax.loss_scaling(...)",
    ),
    (
        "loss_scaling(chain(loss_scaling))",
        lambda: lsj.loss_scaling(optax.chain(_ls()), lsj.DynamicScale()).init(PARAMS),
        ValueError,
        "inner holds another loss scaling",
    ),
    (
        "loss_scaling(MultiSteps)",
        lambda: lsj.loss_scaling(optax.MultiSteps(optax.sgd(0.1), 2), lsj.NoScale()).init(PARAMS),
        ValueError,
        "inner holds optax.MultiSteps",
    ),
    (
        "MultiSteps(loss_scaling)",
        read(optax.MultiSteps(_ls(), 2)),
        ValueError,
        "lossscale_jax.loss_scaling is wrapped in optax.MultiSteps",
    ),
    (
        "inject_hyperparams(loss_scaling)",
        read(
            optax.inject_hyperparams(
                lambda learning_rate: lsj.loss_scaling(optax.sgd(learning_rate), lsj.NoScale())
            )(learning_rate=0.1)
        ),
        ValueError,
        "lossscale_jax.loss_scaling is wrapped in optax.inject_hyperparams",
    ),
    (
        "masked(loss_scaling)",
        read(optax.masked(_ls(), {"w": True})),
        ValueError,
        "lossscale_jax.loss_scaling is wrapped in optax.masked",
    ),
    (
        "multi_transform(loss_scaling)",
        read(optax.multi_transform({"a": _ls()}, {"w": "a"})),
        ValueError,
        "lossscale_jax.loss_scaling is wrapped in optax.multi_transform",
    ),
    (
        "apply_if_finite(loss_scaling)",
        read(optax.apply_if_finite(_ls(), 3)),
        ValueError,
        "lossscale_jax.loss_scaling is wrapped in optax.apply_if_finite",
    ),
    (
        "conditionally_transform(loss_scaling)",
        read(optax.conditionally_transform(_ls(), lambda step: step > 1)),
        ValueError,
        "lossscale_jax.loss_scaling is wrapped in optax.conditionally_mask/conditionally_transform",
    ),
    (
        "other optax wrapper",
        lambda: lsj.get_loss_scale_state(
            optax.lookahead(_ls(), 2, 0.5).init(optax.LookaheadParams.init_synced(PARAMS))
        ),
        ValueError,
        "lossscale_jax.loss_scaling is wrapped in an optax transformation whose state is",
    ),
    (
        "chain(clip, loss_scaling)",
        read(optax.chain(optax.clip_by_global_norm(1.0), _ls())),
        ValueError,
        "lossscale_jax.loss_scaling is one of 2 transformations in an optax.chain",
    ),
    (
        "TrainState of a tx without loss_scaling that returns a bare LossScaleState",
        lambda: lsj.TrainState.create(
            apply_fn=None,
            params=PARAMS,
            tx=optax.GradientTransformation(lambda p: lsj.NoScale().init(), None),
        ),
        ValueError,
        "the optimizer state holds a bare LossScaleState",
    ),
    (
        "pmap without axis_name",
        under_pmap(_ls()),
        ValueError,
        "does not name it, and JAX does not say here whether the gradients vary over it",
    ),
    (
        "shard_map, varying gradients, no axis_name",
        under_shard_map(_ls()),
        ValueError,
        "does not name it, and the gradients vary over it",
    ),
    (
        "shard_map, averaged gradients, saturating, no axis_name",
        under_shard_map(
            lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(), overflow="saturating"), True
        ),
        ValueError,
        "does not name it, and the gradients are the same on every device",
    ),
    (
        "local_axes overlaps axis_name",
        lambda: lsj.loss_scaling(optax.sgd(0.1), lsj.NoScale(), axis_name="b", local_axes="b"),
        ValueError,
        "local_axes and axis_name both name",
    ),
    (
        "restore under another policy",
        restore_under_another_policy,
        ValueError,
        "which StaticScale(scale=8.0, skip_on_overflow=True) would not hold",
    ),
    (
        "check_checkpoint(policy=) on metadata",
        lambda: lsj.check_checkpoint(
            STATE,
            jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), STATE),
            policy=lsj.DynamicScale(),
        ),
        TypeError,
        "check_checkpoint(policy=...) needs the checkpoint's values",
    ),
    (
        "policy without conform",
        policy_without_conform,
        NotImplementedError,
        "does not implement conform(state)",
    ),
    (
        "policy without adjust",
        policy_without_adjust,
        TypeError,
        "Can't instantiate abstract class Mine",
    ),
]


def _torch_saved(**changes):
    return {
        "scale": 1024.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": 0,
        **changes,
    }


def _set_wrong_dtype():
    state = lsj.get_loss_scale_state(STATE)
    lsj.set_loss_scale_state(STATE, state.replace(scale=jnp.float16(2.0)))


# lossscale_jax.compat: checkpoint import/export and the arguments read differently.
CASES += [
    (
        "torch empty",
        lambda: compat.torch.import_state({}),
        ValueError,
        "The source state dict is empty",
    ),
    (
        "saved key missing",
        lambda: compat.torch.import_state({"scale": 1.0}),
        ValueError,
        "the GradScaler state_dict has no 'growth_interval' entry",
    ),
    (
        "saved scale zero",
        lambda: compat.torch.import_state(_torch_saved(scale=0.0)),
        ValueError,
        "scale must be a finite number > 0 to resume from",
    ),
    (
        "saved counter",
        lambda: compat.torch.import_state(_torch_saved(_growth_tracker=2000)),
        ValueError,
        "_growth_tracker must be in [0, 1999]",
    ),
    (
        "keras variables",
        lambda: compat.keras.import_state({"dynamic_scale": 2.0}),
        ValueError,
        "variables must hold exactly one 'step_counter' entry",
    ),
    (
        "megatron constant",
        lambda: compat.megatron.import_state(
            {},
            min_scale=1.0,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=1000,
            hysteresis=2,
        ),
        ValueError,
        "state_dict is empty: a Megatron ConstantGradScaler saves no state",
    ),
    (
        "export no equivalent",
        lambda: compat.torch.export_state(lsj.DynamicScale(), lsj.DynamicScale().init()),
        ValueError,
        "has no torch equivalent",
    ),
    (
        "export opt_state",
        lambda: compat.torch.export_state(compat.torch.GradScaler(), STATE),
        TypeError,
        "state must be a LossScaleState",
    ),
    (
        "set state mismatch",
        _set_wrong_dtype,
        ValueError,
        "loss_scale_state does not match the optimizer state's LossScaleState",
    ),
    (
        "set state dict",
        lambda: lsj.set_loss_scale_state(STATE, {"scale": 2.0}),
        TypeError,
        "loss_scale_state must be a LossScaleState",
    ),
    (
        "jmp period",
        lambda: compat.jmp.DynamicLossScale(8.0, period=5.5),
        ValueError,
        "period must be a whole number",
    ),
    (
        "jmp counter",
        lambda: compat.jmp.DynamicLossScale(8.0, 5, 5),
        ValueError,
        "counter must be in [0, period)",
    ),
    (
        "deepspeed args",
        lambda: compat.deepspeed.FP16_Optimizer(
            optax.sgd(0.1), dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 8}
        ),
        ValueError,
        "dynamic_loss_args must have the keys",
    ),
    (
        "apex growth",
        lambda: compat.apex.update_scale_hysteresis(8.0, 0.5, 0.5, 10, 2),
        ValueError,
        "growth_factor must be >= 1",
    ),
    (
        "keras kwargs",
        lambda: compat.keras.LossScaleOptimizer(optax.sgd(0.1), foo=1),
        ValueError,
        "LossScaleOptimizer does not support arguments: `foo`",
    ),
    (
        "diagnose fn",
        lambda: diagnose("model"),
        TypeError,
        "loss_fn must be a function of (params, batch)",
    ),
    (
        "diagnose reference",
        lambda: diagnose(reference_fn=1.0),
        TypeError,
        "reference_fn must be a function of (params, batch)",
    ),
    (
        "diagnose no batch",
        lambda: diagnose(batches=[]),
        ValueError,
        "batches must hold at least one batch, got none.",
    ),
    (
        "diagnose scale",
        lambda: diagnose(scale=0.0),
        ValueError,
        "scale must be a finite number > 0, got 0.0.",
    ),
    (
        "diagnose scales empty",
        lambda: diagnose(scales=[]),
        ValueError,
        "scales must be a non-empty 1-d sequence of numbers",
    ),
    (
        "diagnose scales negative",
        lambda: diagnose(scales=[1.0, -2.0]),
        ValueError,
        "scales must be finite numbers > 0",
    ),
    (
        "diagnose scales big",
        lambda: diagnose(scales=[1e39]),
        ValueError,
        "scales must fit in float32",
    ),
    (
        "diagnose tolerance",
        lambda: diagnose(tolerance=1.5),
        ValueError,
        "tolerance must be a fraction in [0, 1)",
    ),
    (
        "diagnose per-example loss",
        lambda: diagnose(lambda p, x: jnp.ones(4) * jnp.sum(loss16(p, x))),
        ValueError,
        "loss_fn(params, batch) must return a scalar loss, got (4,).",
    ),
    (
        "diagnose float32 loss",
        lambda: diagnose(lambda p, x: jnp.sum(x.astype(jnp.float32) @ p["w"])),
        ValueError,
        "loss_fn(params, batch) computes nothing in float16 with these params",
    ),
    (
        "diagnose integer params",
        lambda: diagnose(params={"i": jnp.ones(3, jnp.int32)}),
        TypeError,
        "params has no floating leaf: there is no gradient to diagnose.",
    ),
    (
        "diagnose bitcast",
        lambda: diagnose(bitcast_loss),
        ValueError,
        "diagnose cannot evaluate loss_fn in float32: its program uses the primitive "
        "'bitcast_convert_type'",
    ),
    (
        "plot without matplotlib",
        plot_without_matplotlib,
        ImportError,
        "Diagnosis.plot needs matplotlib, an optional dependency: pip install "
        "'lossscale_jax[plot]'",
    ),
    (
        "multi_optimizer list",
        lambda: compat.torch.multi_optimizer([optax.sgd(0.1)], "a", compat.torch.GradScaler()),
        TypeError,
        "transforms must be a non-empty mapping",
    ),
    (
        "fairseq tolerance",
        lambda: compat.fairseq.DynamicLossScaler(tolerance=float("inf")),
        ValueError,
        "tolerance must be a finite number (the fraction of iterations that may overflow",
    ),
    (
        "metaseq fractional factor",
        lambda: compat.metaseq.DynamicLossScaler(scale_factor=1.5),
        ValueError,
        "scale_factor must be a whole number for metaseq's scaler",
    ),
    (
        "fairseq import without loss_scale",
        lambda: compat.fairseq.import_state({"state": {}}),
        ValueError,
        "the fairseq optimizer state_dict has no 'loss_scale' entry",
    ),
    (
        "colossalai min above initial",
        lambda: compat.colossalai.DynamicGradScaler(initial_scale=1.0, min_scale=2.0),
        ValueError,
        "min_scale must be > 0 and <= initial_scale",
    ),
    (
        "paddle incr_ratio",
        lambda: compat.paddle.GradScaler(incr_ratio=1.0),
        ValueError,
        "The incr_ratio must be > 1.0",
    ),
    (
        "paddle op scale below 1",
        lambda: compat.paddle.update_loss_scaling(init_loss_scaling=0.5),
        ValueError,
        "init_loss_scaling must be >= 1 for update_loss_scaling",
    ),
    (
        "paddle empty state_dict",
        lambda: compat.paddle.import_state({}),
        ValueError,
        "The input state dict is empty",
    ),
]


def _sinks_for_a():
    return lsj.taps.discover(lambda w: lsj.tap(w, "a"), 1.0)


def _tap_not_discovered():
    def other(sinks, w):
        with lsj.taps.recording(sinks):
            return lsj.tap(w, "b")

    jax.grad(other)(_sinks_for_a(), 1.0)


def _stacked_taps():
    stacked = jax.tree_util.tree_map(lambda v: jnp.stack([v, v]), _sinks_for_a())
    TX.update(PARAMS, STATE, PARAMS, taps=stacked)


_LAYER_ARGS = ({"w": jnp.ones((3, 3))}, jnp.ones((2, 3)))


def _chain(p, x):
    return jnp.sum(lsj.tap(jnp.tanh(x @ p["w"]), "layer"))


def _tied(p, x):
    return jnp.sum(lsj.tap(x @ p["w"], "layer") @ p["w"].T)


def _layer_map():
    return lsj.layerwise.discover(_chain, *_LAYER_ARGS)


def _layerwise_without_taps():
    tx = lsj.layerwise_scaling(optax.sgd(0.1), _layer_map())
    params = _LAYER_ARGS[0]
    tx.update(params, tx.init(params), params)


def _layerwise_accumulation_fused():
    tx = lsj.layerwise_scaling(optax.sgd(0.1), _layer_map(), every_k=3)
    params = _LAYER_ARGS[0]
    lsj.apply_gradients(tx, params, tx.init(params), params)


def _enter(context):
    with context:
        pass


# Taps (lsj.tap, lsj.taps) used wrongly.
CASES += [
    (
        "layerwise accumulation in the fused step",
        _layerwise_accumulation_fused,
        TypeError,
        "apply_gradients does not take layerwise_scaling(..., every_k=3)",
    ),
    (
        "tap empty name",
        lambda: lsj.tap(jnp.ones(2), ""),
        lsj.errors.TapError,
        "tap name must be a non-empty string",
    ),
    ("tap name not str", lambda: lsj.tap(jnp.ones(2), 3), TypeError, "tap name must be a str"),
    (
        "tap integers",
        lambda: lsj.tap(jnp.arange(3), "i"),
        TypeError,
        "lsj.tap('i'): only a floating array has a gradient to measure",
    ),
    (
        "tap not discovered",
        _tap_not_discovered,
        lsj.errors.TapError,
        "the tap 'b' was not there when the sinks were made",
    ),
    (
        "recording without sinks",
        lambda: _enter(lsj.taps.recording({"a": jnp.zeros(3)})),  # type: ignore[arg-type]
        lsj.errors.TapError,
        "recording needs the sinks lsj.taps.discover made",
    ),
    (
        "recording modules",
        lambda: _enter(lsj.taps.recording(_sinks_for_a(), modules="all")),  # type: ignore
        TypeError,
        "modules must be a bool or a predicate on modules",
    ),
    (
        "recording forward",
        lambda: _enter(lsj.taps.recording(_sinks_for_a(), forward=1)),  # type: ignore
        TypeError,
        "forward must be a bool",
    ),
    (
        "taps not TapStats",
        lambda: TX.update(PARAMS, STATE, PARAMS, taps={"loss": jnp.zeros(3)}),
        lsj.errors.TapError,
        "loss_scaling: taps must be the TapStats lsj.taps.value_and_grad returns",
    ),
    (
        "taps stacked",
        _stacked_taps,
        lsj.errors.TapError,
        "loss_scaling: each tap's statistics must be one pass's (286,) vector",
    ),
    (
        "value_and_grad argnums",
        lambda: lsj.taps.value_and_grad(lambda w: w, argnums=-1),
        ValueError,
        "argnums must be an int >= 0 or a sequence of them",
    ),
    (
        "layerwise policy",
        lambda: lsj.layerwise_scaling(optax.sgd(0.1), _layer_map(), lsj.DynamicScale()),
        TypeError,
        "layerwise_scaling adapts each layer by HeadroomScale's rule",
    ),
    (
        "layerwise layers",
        lambda: lsj.layerwise_scaling(optax.sgd(0.1), ("a",)),  # type: ignore[arg-type]
        TypeError,
        "layers must be the LayerMap lsj.layerwise.discover returns",
    ),
    (
        "layerwise no taps",
        lambda: lsj.layerwise.discover(lambda p, x: jnp.sum(x @ p["w"]), *_LAYER_ARGS),
        lsj.errors.TapError,
        "per-layer scaling found no layer tap in loss_fn",
    ),
    (
        "layerwise tied",
        lambda: lsj.layerwise.discover(_tied, *_LAYER_ARGS),
        lsj.errors.TapError,
        "reaches the loss through different layer taps on different paths",
    ),
    (
        "layerwise update without taps",
        _layerwise_without_taps,
        lsj.errors.TapError,
        "layerwise_scaling: per-layer scaling needs taps=",
    ),
    (
        "diagnose localize",
        lambda: lsj.diagnose(lambda p, b: p, {"w": jnp.ones(2)}, [0], localize=1),
        TypeError,
        "localize must be a bool",
    ),
    (
        "gradients of an unscaled loss",
        lambda: _wired("unscaled"),
        ValueError,
        "loss_scaling: the gradients given to update carry the optimizer state's loss scale to "
        "the power 0: they were computed in this step from a loss that was never multiplied "
        "by the scale",
    ),
    (
        "a loss scaled twice",
        lambda: _wired("twice"),
        ValueError,
        "loss_scaling: the gradients given to update carry the optimizer state's loss scale to "
        "the power 2",
    ),
    (
        "a scaled loss only logged",
        lambda: _wired("logged"),
        ValueError,
        "loss_scaling: the gradients given to update carry the optimizer state's loss scale to "
        "the power 0: they are not the backward pass of the loss lsj.scale_loss scaled in this "
        "step",
    ),
    (
        "gradients unscaled before update",
        lambda: _wired("unscaled_by_hand"),
        ValueError,
        "the scale entered them and was divided out again",
    ),
    (
        "one term of the loss scaled",
        lambda: _wired("one_term"),
        ValueError,
        "a sum of parts that carry the optimizer state's loss scale to different powers",
    ),
    (
        "value_and_grad of a loss that scales itself",
        lambda: _wired("value_and_grad_twice"),
        ValueError,
        "lsj.value_and_grad: the loss function already multiplies its loss by the optimizer "
        "state's loss scale",
    ),
    (
        "unscaled gradients clipped at a scaled threshold (a warning)",
        lambda: _wired("clipped"),
        lsj.errors.WiringWarning,
        "the gradient leaf at ['w'] takes one of several forms",
    ),
    (
        "a scale multiplied by hand beside scale_loss",
        lambda: _wired("by_hand"),
        ValueError,
        "loss_scaling: the gradients given to update carry the optimizer state's loss scale to "
        "the power 2",
    ),
    (
        "two models' states swapped",
        lambda: _wired("swapped"),
        ValueError,
        "loss_scaling: the gradients given to update are scaled by another optimizer state's "
        "loss scale, while this state's scale scaled another loss of the same step",
    ),
    (
        "a scale frozen into the trace",
        lambda: _wired("frozen"),
        ValueError,
        "loss_scaling: lsj.scale_loss multiplied the loss by a loss scale that is a constant of "
        "this traced step",
    ),
    (
        "an integer gradient leaf",
        lambda: _wired("int"),
        TypeError,
        "loss_scaling: the gradient leaf at ['w'] is int32",
    ),
    (
        "MultiSteps around loss scaling, at init",
        lambda: optax.MultiSteps(lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale()), 2).init(
            {"w": jnp.ones(2)}
        ),
        ValueError,
        "lossscale_jax.loss_scaling is wrapped in optax.MultiSteps",
    ),
    (
        "master_weights without params",
        lambda: lsj.master_weights(optax.sgd(0.1)).update(
            {"w": jnp.ones(2)}, lsj.master_weights(optax.sgd(0.1)).init({"w": jnp.ones(2)})
        ),
        ValueError,
        "master_weights needs params",
    ),
]


def _wired(mistake):
    """One jitted step wired with ``mistake`` (tests/test_wiring.py has each case in full)."""
    params = {"w": jnp.ones(2)}
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale())
    state = tx.init(params)

    def loss(p):
        return jnp.sum(p["w"] ** 2)

    def step(p, s, s2):  # s2: a second model's state
        scale = lsj.get_loss_scale_state(s).scale
        if mistake == "int":
            return tx.update({"w": jnp.ones(2, jnp.int32)}, s, p)
        if mistake == "logged":  # the unscaled loss's gradients; the scaled loss for the logs
            value, grads = jax.value_and_grad(loss)(p)
            logged = lsj.scale_loss(value, s)
            return tx.update(grads, s, p), logged
        if mistake == "clipped":  # PyTorch's clip at max_norm * scale, of unscaled gradients
            clip = optax.clip_by_global_norm(1.0 * scale)
            return tx.update(clip.update(jax.grad(loss)(p), clip.init(p))[0], s, p)
        if mistake == "unscaled_by_hand":  # update unscales them once more
            g = jax.grad(lambda q: lsj.scale_loss(loss(q), s))(p)
            return tx.update(lsj.unscale(g, scale), s, p)
        if mistake == "one_term":  # scale_loss(a, s) + b
            g = jax.grad(lambda q: lsj.scale_loss(loss(q), s) + jnp.sum(q["w"]))(p)
            return tx.update(g, s, p)
        if mistake == "value_and_grad_twice":  # a loss function that scales itself
            return lsj.value_and_grad(lambda q: lsj.scale_loss(loss(q), s), s)(p)
        if mistake == "swapped":  # a second model, each loss scaled with the other's state
            other = s2
            first = jax.grad(lambda q: lsj.scale_loss(loss(q), other))(p)
            second = jax.grad(lambda q: lsj.scale_loss(2 * loss(q), s))(p)
            return tx.update(first, s, p), tx.update(second, other, p)
        scaled = {
            "unscaled": loss,
            "twice": lambda q: lsj.scale_loss(lsj.scale_loss(loss(q), s), s),
            "by_hand": lambda q: lsj.scale_loss(loss(q), s) * scale,
            "frozen": lambda q: lsj.scale_loss(loss(q), state),  # the outer state
        }[mistake]
        return tx.update(jax.grad(scaled)(p), s, p)

    return jax.jit(step)(params, state, tx.init(params))


# The cases that map over 8 devices (conftest.py skips them, saying so, where the default
# backend has fewer: a one-GPU machine).
MULTIDEVICE = (
    "pmap without axis_name",
    "shard_map, varying gradients, no axis_name",
    "shard_map, averaged gradients, saturating, no axis_name",
)


@pytest.mark.parametrize(
    "name,call,exc,message",
    [
        pytest.param(*c, marks=[pytest.mark.multidevice(8)] if c[0] in MULTIDEVICE else [])
        for c in CASES
    ],
    ids=[c[0] for c in CASES],
)
def test_error(name, call, exc, message):
    with pytest.raises(exc, match=re.escape(message)):
        call()


def test_every_error_is_in_the_table():
    assert set(MULTIDEVICE) <= {c[0] for c in CASES}
    text = DOC.read_text()
    missing = [m for _, _, _, m in CASES if m not in text]
    assert not missing, f"docs/errors.md lacks {missing}"


# ---- Not errors: documented behaviour for unusual gradient trees. ----


def test_integer_and_bool_leaves_are_refused_float0_leaves_pass():
    params = {"i": jnp.zeros(2, jnp.int32), "b": jnp.zeros(2, jnp.bool_), "w": jnp.ones(2)}
    grads = {
        "i": jnp.array([2**31 - 1, -(2**31)], jnp.int32),
        "b": jnp.array([True, False]),
        "w": jnp.array([1.0, 2.0], jnp.float16),
    }
    for mode in ("ieee", "saturating", "both"):
        assert not bool(lsj.check_overflow(grads, mode))
    # check_overflow reads them (an integer cannot overflow); an update refuses them: they
    # would reach the inner optimizer scaled, neither unscaled nor checked.
    tx = lsj.loss_scaling(optax.identity(), lsj.StaticScale(2.0), overflow="both")
    with pytest.raises(lsj.errors.GradientDtypeError, match=r"\['b'\] is bool"):
        jax.jit(tx.update)(grads, tx.init(params), params)
    with pytest.raises(lsj.errors.GradientDtypeError, match=r"\['i'\] is int32"):
        jax.jit(tx.update)({**grads, "b": np.zeros(2, jax.dtypes.float0)}, tx.init(params), params)
    with pytest.raises(lsj.errors.GradientDtypeError, match="unscale: .*int32"):
        lsj.unscale(grads["i"], 2.0)
    # float0 gradients of integer parameters (jax.grad(..., allow_int=True)): no value.
    g0 = jax.grad(lambda p: jnp.sum(p["w"]) * 1.0, allow_int=True)(params)
    assert g0["i"].dtype == jax.dtypes.float0
    assert not bool(lsj.check_overflow(g0, "both"))
    updates, state = jax.jit(tx.update)(g0, tx.init(params), params)
    assert updates["i"].dtype == jax.dtypes.float0 and not bool(state.loss_scale.last_overflow)
    np.testing.assert_array_equal(np.asarray(updates["w"]), [0.5, 0.5])


def test_none_leaves_and_empty_trees():
    params = {"a": None, "w": jnp.ones(2)}
    tx = lsj.loss_scaling(optax.sgd(1.0), lsj.StaticScale(2.0))
    updates, state = jax.jit(tx.update)(
        {"a": None, "w": jnp.array([2.0, jnp.inf])}, tx.init(params), params
    )
    assert updates["a"] is None and bool(state.loss_scale.last_skipped)
    updates, state = jax.jit(tx.update)({}, tx.init({}), {})
    assert updates == {} and not bool(state.loss_scale.last_overflow)
    assert int(state.loss_scale.total_steps) == 1
    assert not bool(lsj.check_overflow(None)) and not bool(lsj.check_overflow([]))


def test_float64_gradients_under_x64():
    with jax.enable_x64(True):
        params = {"w": jnp.ones(2, jnp.float64)}
        tx = lsj.loss_scaling(optax.sgd(1.0), lsj.StaticScale(4.0), overflow="both")
        g = {"w": jnp.array([1.0, 3.0], jnp.float64)}
        updates, state = tx.update(g, tx.init(params), params)
        assert updates["w"].dtype == jnp.float64 and not bool(state.loss_scale.last_overflow)
        np.testing.assert_array_equal(np.asarray(updates["w"]), [-0.25, -0.75])
        # A float64 value beyond float16's range saturates the check (compute_dtype decides).
        big = {"w": jnp.array([1.0, 1e300], jnp.float64)}
        assert bool(lsj.check_overflow(big, "saturating"))
        assert not bool(lsj.check_overflow(big, "ieee"))


def test_float64_numpy_gradients_without_x64_become_float32():
    g = {"w": np.array([1.0, 1e300])}  # inf once JAX makes it float32
    # JAX says so (without jax_enable_x64 it truncates float64 to float32).
    with pytest.warns(UserWarning, match="float64 .* will be truncated to dtype float32"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # numpy: overflow encountered in cast
            grads, overflow = lsj.unscale_and_check(g, 2.0)
    assert grads["w"].dtype == jnp.float32 and bool(overflow)
