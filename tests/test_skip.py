"""The skip's formulation: the LOSSSCALE_JAX_SKIP switch, and effects confined to applied steps.

A select (XLA:GPU's formulation) computes the good branch on every step. What has an effect in
it, a ``checkify`` check, a debug callback, an inner transformation's own effects, must still
happen only on the steps the decision applies: each test below counts the effects against the
steps applied, derived by hand from the sequence of good and overflowing gradients, under both
formulations and on every front-end that decides (the Optax path, the fused step, a window of
micro-batches, per-layer scaling). ``test_a_bare_select_would_run_them`` shows what the guard
is for: the same effect under a select that does not confine it fires on a skipped step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import checkify

import lossscale_jax as lsj
from lossscale_jax import layerwise as lw
from lossscale_jax.engine import _skip

PARAMS = {"w": jnp.array([0.5, -1.0, 2.0], jnp.float32)}
GOOD = {"w": jnp.array([1.0, 2.0, -3.0], jnp.float16)}
BAD = {"w": jnp.array([1.0, jnp.inf, 0.0], jnp.float16)}
FORMULATIONS = ("cond", "select")


def _fused_step():
    tx = lsj.loss_scaling(optax.adam(1e-3), lsj.DynamicScale())

    def step(g, s, p):
        return lsj.apply_gradients(tx, g, s, p)

    return step, (GOOD, tx.init(PARAMS), PARAMS)


def _conditionals(step, args) -> int:
    return str(jax.make_jaxpr(step)(*args)).count(" cond[")


def _compiled_conditionals(step, args) -> int:
    """Conditionals in the program compiled for the default device, after XLA's passes (where
    ``platform_dependent``'s choice of platform is folded away)."""
    return jax.jit(step).lower(*args).compile().as_text().count(" conditional(")


def _default_platforms_own() -> int:
    """The conditionals the default device's own formulation leaves: GPUs (``jax``'s
    ``"gpu"`` platform, CUDA's and ROCm's) take the select, the CPU and TPUs the cond."""
    return 0 if jax.default_backend() in ("gpu", "cuda", "rocm") else 1


# ------------------------------------------------------------------ the switch


def test_the_environment_variable_picks_the_formulation(monkeypatch):
    monkeypatch.setenv(_skip.ENV, "select")
    assert _conditionals(*_fused_step()) == 0
    monkeypatch.setenv(_skip.ENV, "cond")
    assert _conditionals(*_fused_step()) == 1
    with _skip.formulation("select"):  # the tests' and the benchmark's override comes first
        assert _conditionals(*_fused_step()) == 0
    for unset in (None, ""):
        if unset is None:
            monkeypatch.delenv(_skip.ENV)
        else:
            monkeypatch.setenv(_skip.ENV, unset)
        assert _skip.current() is None
        # each platform's own: the program compiled for the default device has its platform's
        # (the CPU suite: the cond; a GPU process's steps, traced for both of its platforms,
        # keep the select on the GPU)
        assert _compiled_conditionals(*_fused_step()) == _default_platforms_own()


def test_a_process_with_a_gpu_and_the_cpu_traces_both_and_lowers_its_own(monkeypatch):
    # What a GPU process traces (its platforms: the GPU and the CPU), on any machine: the
    # step holds both formulations, platform_dependent between them, and the program compiled
    # for the default device keeps that device's own.
    monkeypatch.delenv(_skip.ENV, raising=False)
    monkeypatch.setattr(_skip, "here", lambda: {"cond", "select"})
    step, args = _fused_step()
    assert "platform_index" in str(jax.make_jaxpr(step)(*args))
    assert _compiled_conditionals(step, args) == _default_platforms_own()


@pytest.mark.parametrize("value", ["where", "Select", "cond,select", " cond"])
def test_the_environment_variable_refuses_other_values(monkeypatch, value):
    monkeypatch.setenv(_skip.ENV, value)
    step, args = _fused_step()
    with pytest.raises(ValueError, match=r"LOSSSCALE_JAX_SKIP must be one of \('cond', 'select'\)"):
        jax.make_jaxpr(step)(*args)


# ------------------------------------------------------------------ effects


def counting(calls: list, inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner``, with a debug callback in its update that records each call's count."""

    def update(updates, state, params=None):
        out, state = inner.update(updates, state, params)
        jax.debug.callback(lambda c: calls.append(int(c)), state[0].count)
        return out, state

    return optax.GradientTransformation(inner.init, update)


def finite_checked(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner``, with a ``checkify`` check in its update that its gradients are finite."""

    def update(updates, state, params=None):
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(u)) for u in jax.tree.leaves(updates)]))
        checkify.check(finite, "the inner transformation was handed a non-finite gradient")
        return inner.update(updates, state, params)

    return optax.GradientTransformation(inner.init, update)


SEQUENCE = [GOOD, BAD, GOOD, GOOD, BAD, BAD, GOOD, GOOD, GOOD, BAD]


def applied_by_hand(every_k: int) -> int:
    """Steps applied over SEQUENCE: a call, or a window of ``every_k`` calls, applies unless
    one of its gradients overflowed (a dynamic scale at 2**15 backs off, never sticks)."""
    windows = [SEQUENCE[i : i + every_k] for i in range(0, len(SEQUENCE), every_k)]
    return sum(all(g is GOOD for g in w) for w in windows if len(w) == every_k)


def stepper(tx, fused: bool):
    """One training step of ``tx``: the fused step, or the Optax path's update and apply."""

    def step(g, s, p):
        if fused:
            return lsj.apply_gradients(tx, g, s, p)
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    return step


def run(tx, fused: bool, formulation: str):
    with _skip.formulation(formulation):
        step = jax.jit(stepper(tx, fused))
        params, state = PARAMS, tx.init(PARAMS)
        for g in SEQUENCE:
            params, state = step(g, state, params)
    jax.effects_barrier()
    return params, state


FRONT_ENDS = {
    "optax": (lambda inner: lsj.loss_scaling(inner, lsj.DynamicScale()), False, 1),
    "fused": (lambda inner: lsj.loss_scaling(inner, lsj.DynamicScale()), True, 1),
    "accumulation": (
        lambda inner: lsj.loss_scaling_multi_steps(inner, lsj.DynamicScale(), every_k=2),
        False,
        2,
    ),
}


@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize("front", sorted(FRONT_ENDS))
def test_an_inner_callback_runs_only_on_applied_steps(front, formulation):
    build, fused, every_k = FRONT_ENDS[front]
    calls: list[int] = []
    _, state = run(build(counting(calls, optax.adam(1e-3))), fused, formulation)
    applied = applied_by_hand(every_k)
    assert applied >= 2  # the sequence applies some steps and skips others
    # Adam's count after each applied step: 1, 2, ..., in order, and nothing for a skipped one
    assert calls == list(range(1, applied + 1))
    assert int(lsj.metrics(state)["total_steps"]) == len(SEQUENCE) // every_k


@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize("front", sorted(FRONT_ENDS))
def test_an_inner_checkify_check_sees_only_applied_steps(front, formulation):
    build, fused, every_k = FRONT_ENDS[front]
    tx = build(finite_checked(optax.sgd(0.1)))
    with _skip.formulation(formulation):
        step = jax.jit(checkify.checkify(stepper(tx, fused)))
        params, state = PARAMS, tx.init(PARAMS)
        for g in SEQUENCE:
            err, (params, state) = step(g, state, params)
            assert err.get() is None, err.get()
    skipped = int(state.loss_scale.skipped_steps)
    assert skipped == len(SEQUENCE) // every_k - applied_by_hand(every_k) > 0


def test_a_bare_select_would_run_them():
    """What the confinement is for: the good branch under a select that does not confine its
    effects (``_skip.select_outputs`` alone) fires the inner check on a skipped step."""
    tx = lsj.loss_scaling(finite_checked(optax.sgd(0.1)), lsj.DynamicScale())
    state = tx.init(PARAMS)

    def good(operands):
        g, inner_state = operands
        return tx.update.inner.update(g, inner_state, PARAMS)

    def skip(operands):
        return jax.tree.map(jnp.zeros_like, operands[0]), operands[1]

    @jax.jit
    @checkify.checkify
    def bare(apply, g):
        return _skip.select_outputs(apply, good, skip, (g, state.inner_state))

    @jax.jit
    @checkify.checkify
    def confined(apply, g):
        with _skip.formulation("select"):
            return _skip.choose(apply, good, skip, (g, state.inner_state))

    inf = {"w": jnp.array([1.0, jnp.inf, 0.0], jnp.float32)}
    assert "non-finite" in bare(jnp.bool_(False), inf)[0].get()
    assert confined(jnp.bool_(False), inf)[0].get() is None
    assert "non-finite" in confined(jnp.bool_(True), inf)[0].get()  # applied: it fires


def test_effects_keep_the_conditional_and_none_keep_the_select():
    calls: list[int] = []
    with _skip.formulation("select"):
        plain = lsj.loss_scaling(optax.adam(1e-3), lsj.DynamicScale())
        effectful = lsj.loss_scaling(counting(calls, optax.adam(1e-3)), lsj.DynamicScale())
        for tx, conditionals in ((plain, 0), (effectful, 1)):
            state = tx.init(PARAMS)
            jaxpr = str(jax.make_jaxpr(lambda g, s, t=tx: t.update(g, s, PARAMS))(GOOD, state))
            assert jaxpr.count(" cond[") == conditionals


# ------------------------------------------------------------------ on_stuck in a window


@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_on_stuck_fires_at_the_window_end_only(formulation):
    tx = lsj.loss_scaling_multi_steps(
        optax.sgd(0.1), lsj.DynamicScale(init_scale=1.0, min_scale=1.0), 2, on_stuck="error"
    )
    with _skip.formulation(formulation):
        step = jax.jit(checkify.checkify(lambda g, s, p: tx.update(g, s, p)))
        state = tx.init(PARAMS)
        err, (_, state) = step(BAD, state, PARAMS)  # mid-window: the decision is not kept
        assert err.get() is None
        err, (_, state) = step(GOOD, state, PARAMS)  # window end: overflow at the floor
        assert "stuck" in err.get()
        err, (_, state) = step(GOOD, state, PARAMS)  # a new window, mid-way
        assert err.get() is None
        err, (_, state) = step(GOOD, state, PARAMS)  # its end: good
        assert err.get() is None


def _tapped_loss(p, x):
    h = lsj.tap(jnp.tanh(x.astype(jnp.float16) @ p["w0"].astype(jnp.float16)), "l0")
    return jnp.sum((h @ p["head"].astype(jnp.float16)).astype(jnp.float32))


@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_on_stuck_fires_at_a_per_layer_windows_end_only(formulation):
    params = {"w0": jnp.full((3, 3), 0.5), "head": jnp.full((3, 2), 0.25)}
    x = jnp.ones((2, 3))
    layers = lw.discover(_tapped_loss, params, x)
    policy = lsj.HeadroomScale(init_scale=1.0, min_scale=1.0)
    tx = lw.layerwise_scaling(optax.sgd(0.1), layers, policy, every_k=2, on_stuck="error")

    with _skip.formulation(formulation):

        @jax.jit
        @checkify.checkify
        def step(s, fault):
            scaled = lambda p: lsj.scale_loss(_tapped_loss(p, x), s)  # noqa: E731
            _, grads, taps = lw.value_and_grad(scaled, layers, s)(params)
            grads = {k: jnp.where(fault, jnp.inf, g) for k, g in grads.items()}
            return tx.update(grads, s, params, taps=taps)[1]

        state = tx.init(params)
        err, state = step(state, True)  # mid-window
        assert err.get() is None
        err, state = step(state, False)  # the window's end: overflow with every scale at 1
        assert "stuck" in err.get()


@pytest.mark.parametrize("front", ["optax", "fused"])
def test_the_inner_update_is_traced_once_per_step(front):
    """A step traced with no override holds both formulations, and the good branch is used for
    its shapes and effects too: the inner transformation's ``update`` still runs once in Python
    (counted by a wrapper around it), as in a plain step, and the step computes what a step
    traced under each formulation alone computes."""
    calls = []
    adam = optax.adam(1e-3)

    def update(g, s, p=None):
        calls.append(1)
        return adam.update(g, s, p)

    tx = lsj.loss_scaling(optax.GradientTransformation(adam.init, update), lsj.DynamicScale())
    state = tx.init(PARAMS)

    def step(g, s, p):
        if front == "fused":
            return lsj.apply_gradients(tx, g, s, p)
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    jitted = jax.jit(step)
    jitted.trace(GOOD, state, PARAMS)
    assert len(calls) == 1
    for grads in (GOOD, BAD):
        both = jitted(grads, state, PARAMS)
        for name in FORMULATIONS:
            with _skip.formulation(name):
                alone = jax.jit(step)(grads, state, PARAMS)
            jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), both, alone)
