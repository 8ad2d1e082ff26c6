"""``lossscale_jax.compat.mpx`` in place of ``mpx``: an mpx program runs unchanged, bit for bit.

The program is mpx's documented training step (its README): ``mpx.filter_value_and_grad``
(or ``filter_grad``) of an Equinox MLP's loss, the loss's mean forced to float32, then
``mpx.optimizer_update`` with optax Adam, over batches poisoned with inf and nan. It runs
once with the real ``mpx`` (mixed-precision-for-jax, a test dependency) and once with
``compat.mpx``; every step's model, Adam state, loss scale, counter, loss and finite flag
must be bit-identical, on the finite and on the skipped steps. The scale starts at mpx's
``FLOAT16_MAX`` (its README's choice), backs off to the floor, sits there through overflows,
grows, is capped at 65504 and backs off from there (to 32752: mpx's scales are not all
powers of two).

Bit equality, not a tolerance: both runs are on one host, and the drop-in computes with
mpx's operations, so the two are the same program (docs/porting.md: with the library's
one-pass overflow check in ``all_finite`` instead, Adam's state came out one ulp apart).
"""

from __future__ import annotations

import io

import equinox as eqx
import jax
import jax.numpy as jnp
import mpx as real_mpx
import numpy as np
import optax
import pytest
from helpers import assert_bits_equal, run_policy, run_python  # noqa: I001  (tests/ is on sys.path under pytest)

import lossscale_jax as lsj
from lossscale_jax.compat import mpx as our_mpx

STEPS = 30
FLOOR = 2.0**13
PERIOD = 3
# Batches poisoned with inf (steps 9 to 12 keep the scale at the floor) and nan.
POISON = {2: np.inf, 5: np.nan, 9: np.inf, 10: np.inf, 11: np.inf, 12: np.inf, 20: np.inf}


def _model():
    # A Module with a field that is not an array (the activation function).
    return eqx.nn.MLP(4, 1, 16, 2, activation=jax.nn.relu, key=jax.random.key(0))


def _batches(steps=STEPS):
    rng = np.random.default_rng(0)
    for i in range(steps):
        x = rng.normal(size=(32, 4)).astype(np.float32)
        y = 3.0 * rng.normal(size=(32, 1)).astype(np.float32)
        if i in POISON:
            x[0, 0] = POISON[i]
        yield x, y


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))]


def _program(mpx, gradient, has_aux, jit):
    """mpx's README step; ``mpx`` is the module a user imported."""
    model = _model()
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    scaling = mpx.DynamicLossScaling(
        loss_scaling=mpx.FLOAT16_MAX,
        min_loss_scaling=jnp.asarray(FLOOR, jnp.float32),
        period=PERIOD,
    )

    def loss_fn(model, x, y):
        pred = jax.vmap(model)(x)
        loss = mpx.force_full_precision(jnp.mean, jnp.float32)((pred - y) ** 2)
        return (loss, jnp.sum(pred)) if has_aux else loss

    def step(model, opt_state, scaling, x, y):
        if gradient == "value_and_grad":
            out = mpx.filter_value_and_grad(loss_fn, scaling, has_aux=has_aux)(model, x, y)
            value, scaling, finite, grads = out
            loss = value[0] if has_aux else value
        else:
            scaling, finite, grads, *_ = mpx.filter_grad(loss_fn, scaling, has_aux=has_aux)(
                model, x, y
            )
            loss = jnp.zeros([])
        model, opt_state = mpx.optimizer_update(model, optimizer, opt_state, grads, finite)
        return model, opt_state, scaling, loss, finite

    if jit == "filter_jit":
        run = eqx.filter_jit(step)
    else:
        # jax.jit traces every leaf of the loss scale, factor and period included.
        params, static = eqx.partition(model, eqx.is_array)

        @jax.jit
        def jitted(params, opt_state, scaling, x, y):
            out = step(eqx.combine(params, static), opt_state, scaling, x, y)
            return (eqx.filter(out[0], eqx.is_array), *out[1:])

        def run(model, opt_state, scaling, x, y):
            params, *rest = jitted(eqx.filter(model, eqx.is_array), opt_state, scaling, x, y)
            return (eqx.combine(params, static), *rest)

    out = []
    for x, y in _batches():
        model, opt_state, scaling, loss, finite = run(model, opt_state, scaling, x, y)
        out.append(
            {
                "model": _leaves(model),
                "opt_state": _leaves(opt_state),
                "scaling": [np.asarray(x) for x in jax.tree_util.tree_leaves(scaling)],
                "loss": np.asarray(loss),
                "finite": np.asarray(finite),
            }
        )
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "gradient, has_aux, jit",
    [
        ("value_and_grad", True, "filter_jit"),
        ("value_and_grad", False, "jax_jit"),
        ("grad", False, "filter_jit"),
        ("grad", True, "jax_jit"),
    ],
)
def test_mpx_program_bit_identical_with_the_import_changed(gradient, has_aux, jit):
    theirs = _program(real_mpx, gradient, has_aux, jit)
    ours = _program(our_mpx, gradient, has_aux, jit)
    for i, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        assert_bits_equal(a, b, f"step {i}")
    # The sequence covers what it claims (the data, not the drop-in, could lose it).
    scales = [float(s["scaling"][0]) for s in ours]
    finite = [bool(s["finite"]) for s in ours]
    before = [65504.0, *scales[:-1]]
    assert scales[0] == 32752.0 and not finite[0]  # 65504 overflows, halves: not a power of 2
    assert any(
        s == FLOOR and b == FLOOR and not f for s, b, f in zip(scales, before, finite, strict=True)
    )
    assert any(s > b for s, b in zip(scales, before, strict=True))  # a growth
    assert any(s == 65504.0 and b == 32768.0 for s, b in zip(scales, before, strict=True))  # capped
    skipped = [i for i, f in enumerate(finite) if not f]
    assert set(POISON) <= set(skipped)
    adam_count = next(x for x in ours[-1]["opt_state"] if x.dtype == np.int32)
    assert int(adam_count) == STEPS - len(skipped)  # Adam advanced on the finite steps only
    for i in skipped:  # a skipped step leaves the model as it was
        was = ours[i - 1]["model"] if i else _leaves(_model())
        assert_bits_equal(ours[i]["model"], was, f"skipped step {i}")


@pytest.mark.slow
@pytest.mark.parametrize("mpx", [real_mpx, our_mpx], ids=["mpx", "compat.mpx"])
def test_a_growth_step_unscales_with_the_grown_scale(mpx):
    # mpx adjusts, then unscales with the new scale: on the period-th good step the value and
    # the gradients come back divided by 2 * S instead of S. One compiled program (jax.jit:
    # the period is traced) at one scale, S = 2**10, with period 2 (the first good step of
    # two: unscaled by S) and period 1 (a growth step): the second is half the first, to the
    # bit; the first is Equinox's gradient of the float16 loss, to float16 precision.
    model, scale = _model(), 2.0**10
    params, static = eqx.partition(model, eqx.is_array)
    x, y = next(_batches(1))

    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2).astype(jnp.float32)

    @jax.jit
    def step(params, scaling):
        fn = mpx.filter_value_and_grad(
            lambda p, x, y: loss_fn(eqx.combine(p, static), x, y), scaling
        )
        return fn(params, x, y)

    out = {}
    for period in (2, 1):
        scaling = mpx.DynamicLossScaling(jnp.float32(scale), jnp.float32(1.0), period=period)
        value, new, finite, grads = step(params, scaling)
        assert bool(finite) and float(new.loss_scaling) == scale * (3 - period)
        out[period] = (value, _leaves(grads))
    halved = jax.tree_util.tree_map(lambda g: g / 2, out[2])
    assert_bits_equal(out[1], halved, "growth step")
    true_value, true_grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    np.testing.assert_allclose(out[2][0], true_value, rtol=2**-8)
    for got, want in zip(out[2][1], _leaves(true_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=2**-6, atol=2**-8 * np.abs(want).max())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["filter_value_and_grad", "filter_grad", "calculate_scaled_grad"])
@pytest.mark.parametrize("has_aux", [False, True])
@pytest.mark.parametrize("use_mixed_precision", [True, False])
def test_every_gradient_function_returns_what_mpx_returns(name, has_aux, use_mixed_precision):
    # Each of mpx's gradient functions, each way, once (eagerly): the same tree of the same
    # bits, the loss scale included (returned unchanged without mixed precision).
    x, y = next(_batches(1))
    outs = []
    for mpx in (real_mpx, our_mpx):

        def loss_fn(model, x, y):
            loss = jnp.mean((jax.vmap(model)(x) - y) ** 2).astype(jnp.float32)
            return (loss, {"n": 3, "pred": loss * 2}) if has_aux else loss

        scaling = mpx.DynamicLossScaling(jnp.float32(2.0**10), jnp.float32(1.0), period=1)
        fn = getattr(mpx, name)(loss_fn, scaling, has_aux, use_mixed_precision)
        out = fn(_model(), x, y=y)  # a keyword argument is cast like the others
        outs.append(
            [np.asarray(v) for v in jax.tree_util.tree_leaves(eqx.filter(out, eqx.is_array))]
        )
        outs[-1].append(len(jax.tree_util.tree_leaves(out)))
    assert_bits_equal(outs[0], outs[1], f"{name}, has_aux={has_aux}")


@pytest.mark.slow
@pytest.mark.parametrize("start", [2.0**16, 65520.0])
def test_a_scale_of_2_16_scales_the_loss_to_inf_as_in_mpx(start):
    # The scale is cast to float16 before it multiplies the loss: 65520 and up are inf.
    x, y = next(_batches(1))
    results = []
    for mpx in (real_mpx, our_mpx):
        scaling = mpx.DynamicLossScaling(jnp.float32(start), jnp.float32(1.0))
        assert not np.isfinite(float(scaling.scale(jnp.float32(1.0))))

        def loss_fn(model, x, y, mpx=mpx):
            return mpx.force_full_precision(jnp.mean, jnp.float32)((jax.vmap(model)(x) - y) ** 2)

        out = eqx.filter_jit(mpx.filter_value_and_grad(loss_fn, scaling))(_model(), x, y)
        value, new, finite, grads = out
        assert not bool(finite) and float(new.loss_scaling) == start / 2
        results.append([np.asarray(value), *jax.tree_util.tree_leaves(new), *_leaves(grads)])
    assert_bits_equal(results[0], results[1], "2**16")
    # The library's own step scales in float32: the same loss at 2**16 trains.
    policy = lsj.DynamicScale(init_scale=start)
    assert np.isfinite(float(lsj.scale_loss(jnp.float32(1.0), policy.init())))


@pytest.mark.parametrize(
    "factor, period, floor, start",
    [(2, 5, 1.0, 2.0**15), (2, 1, 2.0**10, 65504.0), (3, 4, 0.5, 3000.0), (4, 2, 0.0, 2.0**12)],
)
def test_adjust_matches_mpx_over_random_overflows(factor, period, floor, start):
    # 1,200 steps of bursts and Bernoulli noise, under jax.jit (every field traced, as mpx's).
    rng = np.random.default_rng(period)
    flags = np.concatenate([rng.random(600) < 0.1, np.repeat(rng.random(60) < 0.5, 10)])

    def run(mpx):
        scaling = mpx.DynamicLossScaling(
            jnp.float32(start), jnp.float32(floor), factor=factor, period=period
        )

        @jax.jit
        def scan(scaling, flags):
            def body(s, finite):
                s = s.adjust(finite)
                return s, (s.loss_scaling, s.counter)

            return jax.lax.scan(body, scaling, jnp.asarray(flags))[1]

        return jax.tree_util.tree_map(np.asarray, scan(scaling, ~flags))

    assert_bits_equal(run(real_mpx), run(our_mpx), f"factor {factor}, period {period}")


def test_the_loss_scale_has_mpx_leaves_and_checkpoints_across():
    args = (jnp.float32(2.0**12), jnp.float32(4.0))
    theirs = real_mpx.DynamicLossScaling(*args, factor=2, period=7).adjust(jnp.array(True))
    ours = our_mpx.DynamicLossScaling(*args, factor=2, period=7).adjust(jnp.array(True))
    assert isinstance(ours, eqx.Module)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(ours)]
    assert paths == [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(theirs)
    ]
    assert_bits_equal(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs))
    # An mpx checkpoint (eqx.tree_serialise_leaves) restores into the drop-in, and back.
    for saved, like in ((theirs, our_mpx), (ours, real_mpx)):
        buf = io.BytesIO()
        eqx.tree_serialise_leaves(buf, saved)
        buf.seek(0)
        template = like.DynamicLossScaling(jnp.float32(1.0), jnp.float32(1.0), period=1)
        restored = eqx.tree_deserialise_leaves(buf, template)
        assert type(restored) is type(template)
        assert_bits_equal(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(saved))


def test_casts_and_select_match_mpx():
    tree = {
        "f16": jnp.ones(2, jnp.float16),
        "bf16": jnp.ones(2, jnp.bfloat16),
        "f32": np.full(2, 1.5, np.float32),
        "f64": np.ones(2, np.float64),
        "i32": jnp.arange(2),
        "scalar": np.float32(2.5),
        "python": 1.5,
        "fn": jax.nn.relu,
    }
    for name in (
        "cast_to_float32",
        "cast_to_float16",
        "cast_to_bfloat16",
        "cast_to_full_precision",
        "cast_to_half_precision",
    ):
        a, b = getattr(real_mpx, name)(tree), getattr(our_mpx, name)(tree)
        assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b), name
        assert_bits_equal(eqx.filter(a, eqx.is_array), eqx.filter(b, eqx.is_array), name)
    stats = lambda x: (jnp.sum(x), jnp.max(x))  # noqa: E731
    x16 = jnp.full(8, 30000.0, jnp.float16)
    for mpx in (real_mpx, our_mpx):
        assert mpx.force_full_precision(jnp.sum, jnp.float16)(x16).dtype == jnp.float16
    assert_bits_equal(
        real_mpx.cast_function(stats, jnp.float32, jnp.bfloat16)(x16),
        our_mpx.cast_function(stats, jnp.float32, jnp.bfloat16)(x16),
    )
    new = {"w": jnp.ones(2), "fn": jax.nn.relu, "n": 3}
    old = {"w": jnp.zeros(2), "fn": jax.nn.tanh, "n": 4}
    for pred in (True, False):
        a = real_mpx.select_tree(jnp.array(pred), new, old)
        b = our_mpx.select_tree(jnp.array(pred), new, old)
        assert a["fn"] is b["fn"] is jax.nn.relu and a["n"] == b["n"] == 3  # from `a`
        assert_bits_equal(a["w"], b["w"])
    assert_bits_equal(real_mpx.all_finite([]), our_mpx.all_finite([]))


def test_half_precision_datatype_by_name_sets_it_where_mpx_does_not():
    # Documented deviation (docs/porting.md): mpx 0.1.8 converts the name and drops it.
    try:
        real_mpx.set_half_precision_datatype("bfloat16")
        assert real_mpx.half_precision_datatype() == jnp.float16
        our_mpx.set_half_precision_datatype("bfloat16")
        assert our_mpx.half_precision_datatype() == jnp.bfloat16
        assert our_mpx.cast_to_half_precision(jnp.ones(1)).dtype == jnp.bfloat16
        for mpx in (real_mpx, our_mpx):
            mpx.set_half_precision_datatype(jnp.bfloat16)
            assert mpx.half_precision_datatype() == jnp.bfloat16
            with pytest.raises(ValueError):
                mpx.set_half_precision_datatype("float8")
            with pytest.raises(TypeError):
                mpx.set_half_precision_datatype(jnp.float32)
    finally:
        real_mpx.set_half_precision_datatype(jnp.float16)
        our_mpx.set_half_precision_datatype(jnp.float16)
    assert our_mpx.half_precision_datatype() == jnp.float16


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"loss_scaling": 2.0**15}, TypeError, "loss_scaling must be a 0-d floating array"),
        ({"loss_scaling": jnp.ones(2)}, ValueError, "loss_scaling must be a scalar"),
        ({"loss_scaling": jnp.int32(8)}, TypeError, "loss_scaling must be a floating array"),
        ({"loss_scaling": jnp.float32(0.0)}, ValueError, "loss_scaling must be finite and > 0"),
        ({"loss_scaling": jnp.float32(np.inf)}, ValueError, "loss_scaling must be finite"),
        ({"min_loss_scaling": jnp.float32(-1)}, ValueError, "min_loss_scaling must be finite"),
        ({"factor": 1}, ValueError, "factor must be a finite number > 1"),
        ({"factor": "2"}, TypeError, "factor must be a number"),
        ({"period": 0}, ValueError, "period must be a finite number >= 1"),
        ({"period": 2.5}, ValueError, "period must be a whole number"),
        ({"counter": jnp.int32(5), "period": 5}, ValueError, r"counter must be .* \[0, 5\)"),
        ({"counter": jnp.float32(1)}, ValueError, "counter must be an integer scalar"),
    ],
)
def test_bad_arguments_are_refused_when_built(kwargs, error, match):
    args = {"loss_scaling": jnp.float32(2.0**15), "min_loss_scaling": jnp.float32(1.0)}
    with pytest.raises(error, match=match):
        our_mpx.DynamicLossScaling(**{**args, **kwargs})
    with pytest.raises(ValueError, match="grads_finite must be a boolean scalar"):
        our_mpx.DynamicLossScaling(**args).adjust(jnp.array([True, False]))
    with pytest.raises(ValueError, match="pred must be a boolean scalar"):
        our_mpx.select_tree(jnp.array([True]), {"a": jnp.ones(1)}, {"a": jnp.ones(1)})


# --------------------------------------------------------------------------
# Moving an mpx run to the library's own step.


@jax.jit
def _mpx_scan(scaling, finite):
    def body(s, f):
        s = s.adjust(f)
        return s, (s.loss_scaling, s.counter)

    return jax.lax.scan(body, scaling, finite)


@pytest.mark.slow
@pytest.mark.parametrize("period, floor", [(5, 1.0), (2, 2.0**12), (1, 0.0)])
def test_import_state_continues_an_mpx_run_scale_for_scale(period, floor):
    # An mpx run interrupted mid-period continues with the imported policy exactly as with
    # mpx (scales capped at 65504 and floored at min_loss_scaling), and goes back.
    rng = np.random.default_rng(period)  # Bernoulli noise, then bursts of 10
    bad = np.concatenate([rng.random(600) < 0.15, np.repeat(rng.random(60) < 0.5, 10)])
    finite = jnp.asarray(~bad)
    scaling = real_mpx.DynamicLossScaling(jnp.float32(2.0**14), jnp.float32(floor), period=period)
    scaling, _ = _mpx_scan(scaling, finite[:7])
    policy, state = our_mpx.import_state(scaling)
    assert int(state.growth_count) == int(scaling.counter)
    assert float(state.scale) == float(scaling.loss_scaling)
    scaling, theirs = _mpx_scan(scaling, finite[7:])
    ours = run_policy(policy, ~finite[7:], state)
    assert_bits_equal((ours.scale, ours.growth_count), theirs, "scale and counter")
    assert len(set(theirs[0].tolist())) > 3  # the scale moved
    last = jax.tree_util.tree_map(lambda x: x[-1], ours)
    back = real_mpx.DynamicLossScaling(**our_mpx.export_state(policy, last))
    assert_bits_equal((back.loss_scaling, back.counter), (scaling.loss_scaling, scaling.counter))
    assert float(back.min_loss_scaling) == max(floor, 2.0**-126)  # a floor of 0 is 2**-126
    assert (back.factor, back.period) == (2, period)


def test_export_state_refuses_a_policy_mpx_cannot_express():
    with pytest.raises(ValueError, match="no mpx equivalent"):
        our_mpx.export_state(lsj.DynamicScale(), lsj.DynamicScale().init())
    with pytest.raises(ValueError, match="min_loss_scaling must be in"):
        our_mpx.dynamic_loss_scaling_policy(2.0**15, 2.0**17)
    with pytest.raises(TypeError, match="scaling must be an mpx DynamicLossScaling"):
        our_mpx.import_state({"loss_scaling": 1.0})


@pytest.mark.slow
def test_the_library_step_unscales_with_the_scale_the_loss_was_scaled_with():
    # The corrected behaviour (docs/porting.md): the imported policy in lsj.loss_scaling takes
    # mpx's skip decisions and scales, and hands the inner optimizer the true gradient where
    # mpx hands over half of it (its growth steps). optax.sgd(1.0): updates = -gradients. The
    # model stays fixed, so both see the same batches at the same weights.
    model = _model()
    params, static = eqx.partition(model, eqx.is_array)
    scaling = real_mpx.DynamicLossScaling(jnp.float32(2.0**10), jnp.float32(1.0), period=3)
    policy, state = our_mpx.import_state(scaling)
    tx = lsj.loss_scaling(optax.sgd(1.0), policy)
    opt_state = lsj.set_loss_scale_state(tx.init(params), state)

    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2).astype(jnp.float32)

    @eqx.filter_jit
    def mpx_step(scaling, x, y):
        _, scaling, finite, grads = real_mpx.filter_value_and_grad(loss_fn, scaling)(model, x, y)
        return scaling, finite, grads

    @eqx.filter_jit
    def lsj_step(opt_state, x, y):
        half = real_mpx.cast_to_half_precision((params, x, y))
        scaled = lambda p: lsj.scale_loss(loss_fn(eqx.combine(p, static), *half[1:]), opt_state)  # noqa: E731
        grads = eqx.filter_grad(scaled)(half[0])
        updates, opt_state = tx.update(grads, opt_state, params)
        return opt_state, jax.tree_util.tree_map(jnp.negative, updates)

    growths = 0
    for i, (x, y) in enumerate(_batches(24)):
        before = float(scaling.loss_scaling)
        scaling, finite, theirs = mpx_step(scaling, x, y)
        opt_state, ours = lsj_step(opt_state, x, y)
        m = lsj.metrics(opt_state)
        assert bool(m["skipped"]) == (not bool(finite)), i
        assert float(m["loss_scale"]) == float(scaling.loss_scaling), i
        if not bool(finite):
            continue
        grew = float(scaling.loss_scaling) / before
        growths += grew == 2.0
        # Powers of two: x / S and x * (1 / S) are the same float32 number. The two float16
        # backward passes are compiled apart: on XLA:CPU they round alike (checked to the
        # bit); another backend may round them differently, by a float16 rounding or so.
        want = jax.tree_util.tree_map(lambda g, k=grew: g * k, eqx.filter(theirs, eqx.is_array))
        if jax.default_backend() == "cpu":
            assert_bits_equal(_leaves(ours), _leaves(want), f"step {i}")
        else:
            for a, b in zip(_leaves(ours), _leaves(want), strict=True):
                np.testing.assert_allclose(a, b, rtol=2**-9, atol=2**-9 * np.abs(b).max())
    assert growths >= 2


@pytest.mark.slow
def test_lossscale_jax_compat_imports_without_equinox():
    code = """
        import sys
        sys.modules["equinox"] = None          # as if Equinox were not installed
        import lossscale_jax as lsj
        print(sorted(lsj.compat.__all__)[:3])
        try:
            lsj.compat.mpx
        except ModuleNotFoundError as e:
            print(e)
    """
    assert run_python(code).splitlines() == [
        "['apex', 'colossalai', 'cstorch']",
        "lossscale_jax.compat.mpx needs Equinox (pip install equinox); the rest of "
        "lossscale_jax does not.",
    ]
