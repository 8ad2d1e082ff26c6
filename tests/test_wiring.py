"""The wiring check: the wirings a training loop invites that would train silently wrong are
refused while the step is traced, and the right ones never see a message.

Each refused case is one users met: gradients of a loss that was never scaled (also when
``scale_loss`` is called in the step only to log the scaled loss, or when the scale reaches
the gradients only through a clipping threshold), a loss scaled twice (also by a hand-written
multiplication after ``scale_loss``), two models' states swapped, a scale frozen into the
trace, integer gradient leaves. The numbers in the comments are what the step did without
the check (derived by hand: SGD's update is -lr * g, divided by the scale when the loss was
not multiplied by it); the new cases measure them with the check switched off. The suite
runs with warnings as errors, so every step here that is not expected to warn would fail if
it did; tests/test_wiring_right.py holds the right wirings of many frameworks and patterns.
"""

from __future__ import annotations

import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import lossscale_jax as lsj
from lossscale_jax.engine import _tracers
from lossscale_jax.errors import GradientDtypeError, NestingError, WiringError, WiringWarning

X = jnp.arange(12.0, dtype=jnp.float32).reshape(4, 3) / 10
PARAMS = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
POLICIES = {
    "dynamic": lsj.DynamicScale(init_scale=2.0**10),
    "static": lsj.StaticScale(64.0),
    "headroom": lsj.HeadroomScale(),
}


def loss_fn(p, x=X):
    return jnp.mean((x.astype(jnp.float16) @ p["w"].astype(jnp.float16) + p["b"]) ** 2).astype(
        jnp.float32
    )


def test_every_admitted_jax_has_the_internals_the_check_reads():
    # Fails here, in both CI legs (the newest JAX and the floor), before a JAX release that
    # moved them makes the check silently blind.
    assert _tracers.AVAILABLE


# -- 1. gradients of a loss that was never scaled -------------------------------------------


@pytest.mark.parametrize("name", list(POLICIES))
def test_gradients_of_an_unscaled_loss_are_refused(name):
    tx = lsj.loss_scaling(optax.sgd(0.1), POLICIES[name])

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(loss_fn)(params)  # a trainer that takes grad(loss) itself
        return tx.update(grads, opt_state, params)

    with pytest.raises(WiringError, match="loss scale to the power 0: .* never multiplied"):
        step(PARAMS, tx.init(PARAMS))


def test_the_refusal_names_the_fix_and_holds_for_the_fused_step_and_accumulation():
    fronts = {
        "loss_scaling": lambda tx: lambda g, s, p: tx.update(g, s, p),
        "apply_gradients": lambda tx: lambda g, s, p: lsj.apply_gradients(tx, g, s, p),
    }
    for make in fronts.values():
        tx = lsj.loss_scaling(optax.adam(1e-3), lsj.DynamicScale())
        run = make(tx)
        step = jax.jit(lambda p, s, run=run: run(jax.grad(loss_fn)(p), s, p))
        with pytest.raises(WiringError) as e:
            step(PARAMS, tx.init(PARAMS))
        assert str(e.value).startswith("loss_scaling: ")
        assert "lsj.scale_loss(loss, opt_state)" in str(e.value)
        assert "lsj.value_and_grad(loss_fn, opt_state)" in str(e.value)
    tx = lsj.loss_scaling_multi_steps(optax.sgd(0.1), lsj.DynamicScale(), every_k=2)
    step = jax.jit(lambda p, s: tx.update(jax.grad(loss_fn)(p), s, p))
    with pytest.raises(WiringError, match="^loss_scaling_multi_steps: "):
        step(PARAMS, tx.init(PARAMS))


def test_an_nnx_optimizer_fed_gradients_of_an_unscaled_loss_is_refused():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    opt = lsj.LossScaleOptimizer(
        model, lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale()), wrt=nnx.Param
    )

    @nnx.jit
    def step(model, opt):
        grads = nnx.grad(lambda m: jnp.mean(m(X) ** 2))(model)
        opt.update(model, grads)

    with pytest.raises(WiringError, match="never multiplied"):
        step(model, opt)


def test_loss_scaling_inside_multisteps_is_refused_when_built():
    # A trainer's own accumulation wraps the optimizer it is given in optax.MultiSteps; its
    # step never reads the state through scale_loss, so the refusal comes at init.
    tx = optax.MultiSteps(lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale()), 2)
    with pytest.raises(NestingError, match="loss_scaling_multi_steps"):
        tx.init(PARAMS)
    with pytest.raises(NestingError, match="wrapped in optax.MultiSteps"):
        nnx.Optimizer(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), tx, wrt=nnx.Param)


# -- 2. a loss scaled twice --------------------------------------------------------------


def _scales_twice_directly(p, s):
    return lsj.scale_loss(lsj.scale_loss(loss_fn(p), s), s)


def _helper_scales_caller_scales_again(p, s):
    def helper(p):  # a helper that scales ...
        return lsj.scale_loss(loss_fn(p), s)

    return lsj.scale_loss(0.5 * helper(p) + 0.1 * jnp.sum(p["b"] ** 2), s)  # ... and again


@pytest.mark.parametrize(
    ("twice", "message"),
    [
        # scale_loss of a loss that carries the scale: the gradients carry it squared
        (_scales_twice_directly, "to the power 2 .* too large by the scale"),
        # a scaled part plus an unscaled one, scaled again: the gradients carry the scale to
        # the powers 2 and 1, refused at the update
        (_helper_scales_caller_scales_again, "different powers .* powers seen: 1, 2"),
    ],
)
@pytest.mark.parametrize("name", ["dynamic", "static"])
def test_a_loss_scaled_twice_is_refused(name, twice, message):
    # Before: StaticScale(64) gave SGD updates 64x too large; DynamicScale backed off to
    # 2**7 and applied updates 2**7 too large.
    tx = lsj.loss_scaling(optax.sgd(0.1), POLICIES[name])

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(lambda p: twice(p, opt_state))(params)
        return tx.update(grads, opt_state, params)

    with pytest.raises(WiringError, match=message):
        step(PARAMS, tx.init(PARAMS))


def test_value_and_grad_of_a_loss_function_that_scales_itself_is_refused():
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale())

    @jax.jit
    def step(params, opt_state):
        scaled_loss_fn = lambda p: lsj.scale_loss(loss_fn(p), opt_state)  # noqa: E731
        return lsj.value_and_grad(scaled_loss_fn, opt_state)(params)

    with pytest.raises(WiringError, match="^lsj.value_and_grad: .* would be scaled twice"):
        step(PARAMS, tx.init(PARAMS))


# -- 3. a scale frozen into the trace ------------------------------------------------------


def test_a_scale_read_through_a_closure_is_refused_under_jit():
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=2.0**15))
    outer_state = tx.init(PARAMS)

    @jax.jit
    def step(params, opt_state):
        # outer_state, not the argument: the scale of the step that was traced, forever
        grads = jax.grad(lambda p: lsj.scale_loss(loss_fn(p), outer_state))(params)
        return tx.update(grads, opt_state, params)

    with pytest.raises(WiringError, match=r"constant of this traced step \(32768\)"):
        step(PARAMS, outer_state)


def test_a_scale_read_through_the_outer_nnx_optimizer_is_refused():
    # The Tunix run: the loss read the outer optimizer object while nnx.jit traced the
    # argument; the loss used 32768 while the state grew to 131072 (gradients 4x too small).
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    outer = lsj.LossScaleOptimizer(
        model, lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale()), wrt=nnx.Param
    )

    @nnx.jit
    def step(model, opt):
        def loss(m):
            return lsj.scale_loss(jnp.mean(m(X) ** 2), outer.opt_state)  # the outer object

        opt.update(model, nnx.grad(loss)(model))

    with pytest.raises(WiringError, match="constant of this traced step"):
        step(model, outer)


def test_a_constant_policy_read_through_a_closure_is_right():
    # StaticScale's scale never moves: a closure cannot freeze a stale value.
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.StaticScale(64.0))
    outer_state = tx.init(PARAMS)

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(lambda p: lsj.scale_loss(loss_fn(p), outer_state))(params)
        return tx.update(grads, opt_state, params)

    updates, _ = step(PARAMS, outer_state)
    want = jax.tree_util.tree_map(lambda g: -0.1 * g, jax.grad(loss_fn)(PARAMS))
    for k in want:  # 64 is a power of two: scaling and unscaling are exact
        np.testing.assert_allclose(np.asarray(updates[k]), np.asarray(want[k]), rtol=1e-6)


# -- 4. integer and bool gradient leaves -----------------------------------------------------


def test_an_integer_gradient_leaf_is_refused():
    # Before: updates [-204.8, -102.4, -0] where the float16 gradient gives [-0.2, -0.1, -0].
    params = {"w": jnp.zeros(3)}
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.StaticScale(1024.0))
    grads = {"w": jnp.array([2048, 1024, 0], jnp.int32)}
    with pytest.raises(GradientDtypeError, match=r"\['w'\] is int32"):
        tx.update(grads, tx.init(params), params)
    assert isinstance(GradientDtypeError("x"), TypeError)
    updates, _ = tx.update({"w": grads["w"].astype(jnp.float16)}, tx.init(params), params)
    np.testing.assert_allclose(np.asarray(updates["w"]), [-0.2, -0.1, -0.0], rtol=1e-6)


# -- 5. the gradients must be the backward pass of the loss scale_loss scaled, once ---------


def _unchecked():
    """The check switched off (the documented block): the step as it trains without the
    check, to measure what the check prevents."""
    return lsj.no_wiring_check()


def loss32(p, x=X):
    """``loss_fn`` in float32: no overflow, whatever the scale, to measure ratios on."""
    return jnp.mean((x @ p["w"] + p["b"]) ** 2)


def _ratio(step, tx, params=PARAMS):
    """The step's SGD updates over the right ones (-0.1 times the gradients of ``loss32``),
    measured with the check off (traced anew: a wrapper JAX has not cached): one number for
    every entry."""
    with _unchecked():
        updates, _ = jax.jit(lambda *a: step(*a))(params, tx.init(params))
    want = jax.grad(loss32)(params)
    ratios = np.concatenate(
        [np.ravel(np.asarray(updates[k]) / (-0.1 * np.asarray(want[k]))) for k in want]
    )
    np.testing.assert_allclose(ratios, ratios[0], rtol=1e-3)
    return float(ratios[0])


def test_a_scaled_loss_only_logged_is_refused():
    # The gradients of the unscaled loss, scale_loss called only for the logged value: each
    # update 1/4096 of the right one at 2**12.
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=2.0**12))

    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss32)(params)
        logged = lsj.scale_loss(loss, opt_state)  # for the logs
        updates, opt_state = tx.update(grads, opt_state, params)
        return updates, (opt_state, logged)

    assert _ratio(step, tx) == pytest.approx(2.0**-12, rel=1e-3)
    with pytest.raises(
        WiringError, match="power 0: they are not the backward pass of the loss"
    ) as e:
        jax.jit(step)(PARAMS, tx.init(PARAMS))
    assert "too small by the scale (2**12 at this DynamicScale's start" in str(e.value)
    assert "lsj.value_and_grad(loss_fn, opt_state)" in str(e.value)


def test_unscaled_gradients_clipped_at_a_scaled_threshold_warn():
    # PyTorch's habit: clip at max_norm * loss scale. The threshold reads the scale, the
    # gradients do not carry it: 1/4096 at 2**12 (the clip does not bind here). Where the
    # clip binds, the clipped gradients carry the scale (their size is right), so the check
    # cannot prove every step wrong: it warns, naming both forms.
    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=2.0**12))

    def step(params, opt_state):
        scale = lsj.get_loss_scale_state(opt_state).scale
        grads = jax.grad(loss32)(params)
        clip = optax.clip_by_global_norm(1.0 * scale)
        grads, _ = clip.update(grads, clip.init(params))
        return tx.update(grads, opt_state, params)

    assert _ratio(step, tx) == pytest.approx(2.0**-12, rel=1e-3)
    with pytest.warns(WiringWarning, match=r"after \(power 1\), free \(power 0\)"):
        jax.jit(step)(PARAMS, tx.init(PARAMS))


@pytest.mark.parametrize("where", ["after", "before"])
def test_a_scale_multiplied_by_hand_besides_scale_loss_is_refused(where):
    # scale_loss(loss, s) * s's scale (or scale_loss of loss * scale): scaled twice, every
    # update too large by the scale: 256x once DynamicScale has backed off to 2**8.
    policy = lsj.DynamicScale(init_scale=2.0**8)
    tx = lsj.loss_scaling(optax.sgd(0.1), policy)

    def twice(p, s):
        scale = lsj.get_loss_scale_state(s).scale
        if where == "after":
            return lsj.scale_loss(loss32(p), s) * scale
        return lsj.scale_loss(loss32(p) * scale, s)

    def step(params, opt_state):
        return tx.update(jax.grad(lambda p: twice(p, opt_state))(params), opt_state, params)

    assert _ratio(step, tx) == pytest.approx(2.0**8, rel=1e-3)
    message = {
        "after": "carry the optimizer state's loss scale to the power 2",  # at the update
        "before": "carry the optimizer state's loss scale to the power 2",
    }[where]
    with pytest.raises(WiringError, match=message) as e:
        jax.jit(step)(PARAMS, tx.init(PARAMS))
    assert "too large by the scale (2**8 at this DynamicScale's start" in str(e.value)


def _gan(swap):
    """Two models, a state each (G's scale 2**8, D's 2**4): each loss scaled with its own
    state, or with the other's (``swap``), and both updated."""
    g_tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=2.0**8))
    d_tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=2.0**4))

    def step(g, d, gs, ds):
        d_state, g_state = (gs, ds) if swap else (ds, gs)
        d_grads = jax.grad(lambda q: lsj.scale_loss(loss32(q), d_state))(d)
        g_grads = jax.grad(lambda q: lsj.scale_loss(loss32(q, 2 * X), g_state))(g)
        d_up, ds = d_tx.update(d_grads, ds, d)
        g_up, gs = g_tx.update(g_grads, gs, g)
        return d_up, g_up

    return step, (PARAMS, PARAMS, g_tx.init(PARAMS), d_tx.init(PARAMS))


def test_two_models_with_swapped_states_are_refused():
    # D's loss scaled with G's state and the reverse: D's updates 16x too large, G's 1/16.
    step, args = _gan(swap=True)
    with _unchecked():
        d_up, g_up = jax.jit(lambda *a: step(*a))(*args)
    d_want, g_want = jax.grad(loss32)(PARAMS), jax.grad(loss32)(PARAMS, 2 * X)
    np.testing.assert_allclose(d_up["w"], -0.1 * 16 * d_want["w"], rtol=1e-5)
    np.testing.assert_allclose(g_up["w"], -0.1 / 16 * g_want["w"], rtol=1e-5)
    with pytest.raises(WiringError, match="the two states are swapped"):
        jax.jit(step)(*args)
    right, args = _gan(swap=False)
    d_up, g_up = jax.jit(right)(*args)  # each its own: no message
    np.testing.assert_allclose(d_up["w"], -0.1 * d_want["w"], rtol=1e-5)


def test_one_state_scaling_both_losses_warns():
    # G's state for both losses (D's state read by no scale_loss): right only while the two
    # scales are equal, which the trace cannot tell.
    g_tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=2.0**8))
    d_tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=2.0**4))

    @jax.jit
    def step(g, d, gs, ds):
        d_grads = jax.grad(lambda q: lsj.scale_loss(loss_fn(q), gs))(d)
        g_grads = jax.grad(lambda q: lsj.scale_loss(loss_fn(q), gs))(g)
        return d_tx.update(d_grads, ds, d)[0], g_tx.update(g_grads, gs, g)[0]

    with pytest.warns(WiringWarning, match="another state's scale"):
        step(PARAMS, PARAMS, g_tx.init(PARAMS), d_tx.init(PARAMS))


def test_the_refusal_names_the_policys_scale_and_tunix_where_it_is_imported(monkeypatch):
    def step_of(tx):
        return jax.jit(lambda p, s: tx.update(jax.grad(loss_fn)(p), s, p))

    tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=2.0**10))
    with pytest.raises(WiringError) as e:
        step_of(tx)(PARAMS, tx.init(PARAMS))
    assert "(2**10 at this DynamicScale's start" in str(e.value)
    assert "2**15" not in str(e.value) and "tunix" not in str(e.value)
    static = lsj.loss_scaling(optax.sgd(0.1), lsj.StaticScale(64.0))
    with pytest.raises(WiringError, match=r"too small by the scale \(2\*\*6, StaticScale's\)"):
        step_of(static)(PARAMS, static.init(PARAMS))
    # A trainer's step (grad of an unscaled loss) with Tunix imported: its integration named.
    monkeypatch.setitem(sys.modules, "tunix", types.ModuleType("tunix"))
    with pytest.raises(WiringError) as e:
        step_of(tx)(PARAMS, tx.init(PARAMS))
    assert "lossscale_jax.integrations.tunix.enable(trainer)" in str(e.value)


# -- the right wirings see nothing ---------------------------------------------------------


def _sgd(policy=None):
    return lsj.loss_scaling(optax.sgd(0.1), policy or lsj.DynamicScale(init_scale=2.0**10))


def test_gradients_from_another_jit_and_eager_steps_pass():
    tx = _sgd()
    state = tx.init(PARAMS)
    grads = jax.jit(jax.grad(lambda p: lsj.scale_loss(loss_fn(p), state)))(PARAMS)
    jax.jit(tx.update)(grads, state, PARAMS)  # the check cannot see into another jit
    tx.update(jax.grad(loss_fn)(PARAMS), state, PARAMS)  # eager: not seen (docs say so)


def test_no_scale_and_a_static_scale_of_one_need_no_scale_loss():
    for policy in (lsj.NoScale(), lsj.StaticScale(1.0)):
        tx = lsj.loss_scaling(optax.sgd(0.1), policy)
        step = jax.jit(lambda p, s, tx=tx: tx.update(jax.grad(loss_fn)(p), s, p))
        step(PARAMS, tx.init(PARAMS))


def test_a_hand_written_multiplication_by_the_states_scale_passes():
    tx = _sgd()

    @jax.jit
    def step(params, opt_state):
        scale = lsj.get_loss_scale_state(opt_state).scale
        grads = jax.grad(lambda p: loss_fn(p) * scale)(params)
        return tx.update(grads, opt_state, params)

    step(PARAMS, tx.init(PARAMS))


def test_several_steps_micro_batches_and_scans_in_one_jit_pass():
    tx = _sgd()

    @jax.jit
    def two_steps(params, opt_state):
        for _ in range(2):  # the second loss depends on the first step's update
            scaled = lambda p, s=opt_state: lsj.scale_loss(loss_fn(p), s)  # noqa: E731
            loss, grads = jax.value_and_grad(scaled)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    two_steps(PARAMS, tx.init(PARAMS))

    acc = lsj.loss_scaling_multi_steps(optax.sgd(0.1), lsj.DynamicScale(), every_k=2)

    @jax.jit
    def window_in_a_scan(params, opt_state, xs):
        def body(state, x):
            grads = jax.grad(lambda p: lsj.scale_loss(loss_fn(p, x), state))(params)
            updates, state = acc.update(grads, state, params)
            return state, updates

        return jax.lax.scan(body, opt_state, xs)

    window_in_a_scan(PARAMS, acc.init(PARAMS), jnp.stack([X, 2 * X]))


def test_two_sums_of_scaled_losses_are_scaled_once():
    tx = _sgd(lsj.StaticScale(64.0))

    @jax.jit
    def step(params, opt_state):
        def total(p):  # two scaled losses added: the sum is scaled once
            return lsj.scale_loss(loss_fn(p), opt_state) + lsj.scale_loss(
                jnp.sum(p["b"] ** 2), opt_state
            )

        return tx.update(jax.grad(total)(params), opt_state, params)

    step(PARAMS, tx.init(PARAMS))


def test_gradients_scaled_with_another_state_of_the_step_warn():
    # Micro-batch gradients all taken with the window's first state, then updated one by one:
    # right within a window (the scale is constant there), so a warning, not an error.
    tx = lsj.loss_scaling_multi_steps(optax.sgd(0.1), lsj.DynamicScale(), every_k=2)

    @jax.jit
    def step(params, opt_state):
        first = opt_state
        grads = [
            jax.grad(lambda p, x=x: lsj.scale_loss(loss_fn(p, x), first))(params)
            for x in (X, 2 * X)
        ]
        for g in grads:
            _, opt_state = tx.update(g, opt_state, params)
        return opt_state

    with pytest.warns(WiringWarning, match="another state's scale"):
        step(PARAMS, tx.init(PARAMS))


def _window_step():
    """Micro-batch gradients all taken with the window's first state (the warned wiring)."""
    acc = lsj.loss_scaling_multi_steps(optax.sgd(0.1), lsj.DynamicScale(), every_k=2)

    def step(params, opt_state):
        first = opt_state
        for x in (X, 2 * X):
            g = jax.grad(lambda p, x=x: lsj.scale_loss(loss_fn(p, x), first))(params)
            _, opt_state = acc.update(g, opt_state, params)
        return opt_state

    return step, acc.init(PARAMS), PARAMS


def _right_step(policy=None, params=PARAMS, inner=None):
    tx = lsj.loss_scaling(inner or optax.sgd(0.1), policy or lsj.DynamicScale(init_scale=2.0**10))

    def step(params, opt_state):
        loss, grads = lsj.value_and_grad(loss_fn, opt_state)(params)
        return tx.update(grads, opt_state, params), loss

    with warnings.catch_warnings():  # float16 parameters: the init's Float16OptimizerWarning
        warnings.simplefilter("ignore")
        return step, tx.init(params), params


PROGRAMS = {
    "right": _right_step,
    "headroom": lambda: _right_step(lsj.HeadroomScale()),
    "float16 parameters (the landing check)": lambda: _right_step(
        params=jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), PARAMS),
        inner=optax.adam(1e-3),
    ),
    "warned window": _window_step,
    "two models": lambda: _two_models(),  # defined below
}


def _two_models():
    """The GAN's step, each loss scaled with its own model's state, as (params, states)."""
    run, (g, d, gs, ds) = _gan(swap=False)
    return (lambda p, s: run(p[0], p[1], s[0], s[1])), (gs, ds), (g, d)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_the_check_changes_no_program(name):
    # A step's program is the same with and without the check looking at it (a right
    # wiring, one that warns): the check only reads the trace. make_jaxpr traces anew each
    # time (no cache).
    step, state, params = PROGRAMS[name]()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with_check = str(jax.make_jaxpr(step)(params, state))
    assert [w.category for w in seen] == ([WiringWarning] if name == "warned window" else [])
    with _unchecked(), warnings.catch_warnings():
        warnings.simplefilter("error")  # the check sees nothing: no warning
        without = str(jax.make_jaxpr(step)(params, state))
    assert with_check == without
