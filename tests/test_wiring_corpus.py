"""The wiring check against a corpus: right wirings never see it, wrong ones are refused or
warned with what the analysis found.

Right: every wiring of ``WIRINGS`` (the README's, a hand-written ``loss * scale``, a vjp seeded
with the scale, a factor of the scale that cancels, PyTorch AMP's gradient-penalty recipe
written with ``g / scale``, ``lsj.unscale`` and ``lsj.unscaled_global_norm``, MAML whose inner
step unscales, accumulation in a scan and a fori_loop, per-example gradients under vmap, a
jit or a remat around the scaled loss, a where guarding it) over 8 losses of ``LOSSES``
each (float32, float16 and bfloat16 compute, softmax cross-entropy, attention, a norm, ReLU
and leaky ReLU, remat, a custom_vjp, a scan, a cond, a fori_loop, an embedding): each step
traced with warnings as errors (the suite's setting) and its SGD update compared with the one
the float32 gradient of the same objective gives, taken by ``jax.grad`` apart from the step.
The scale is a power of two, so scaling and unscaling are exact; float32 sums taken in another
order and second-order terms give the tolerance (1e-4, the issue's bound; float16 and
bfloat16 compute: their own rounding, 1e-2 and 5e-2).

Wrong: each case of ``WRONG`` measured with the check off (the ratio of its update to the
right one, derived by hand in the comment) and then refused or warned with a message that
says what the analysis found, in the right direction, naming both off switches.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale_jax as lsj
from lossscale_jax.errors import WiringError, WiringWarning

K = jax.random.split(jax.random.PRNGKey(3), 4)
X = jax.random.normal(K[0], (8, 3))
Y = jax.random.normal(K[1], (8, 2))
PARAMS = {"w": jax.random.normal(K[2], (3, 2)) * 0.5, "b": jnp.full((2,), 0.1)}
LR = 0.1
SCALE = 2.0**10


# -- losses: (params, x, y) -> float32 scalar ---------------------------------------------


def _mse(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)


def _float16(p, x, y):
    h = x.astype(jnp.float16) @ p["w"].astype(jnp.float16) + p["b"].astype(jnp.float16)
    return jnp.mean((jnp.tanh(h) - y.astype(jnp.float16)) ** 2).astype(jnp.float32)


def _bfloat16(p, x, y):
    h = x.astype(jnp.bfloat16) @ p["w"].astype(jnp.bfloat16) + p["b"].astype(jnp.bfloat16)
    return jnp.mean((jnp.tanh(h) - y.astype(jnp.bfloat16)) ** 2).astype(jnp.float32)


def _cross_entropy(p, x, y):
    labels = jax.nn.one_hot(jnp.argmax(y, axis=1), 2)
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(x @ p["w"] + p["b"]), axis=1))


def _attention(p, x, y):
    q = x @ p["w"]
    weights = jax.nn.softmax(q @ q.T / np.sqrt(2.0), axis=-1)
    return jnp.mean((weights @ y + p["b"] - y) ** 2)


def _normed(p, x, y):
    h = x @ p["w"] + p["b"]
    h = (h - jnp.mean(h, axis=1, keepdims=True)) * jax.lax.rsqrt(
        jnp.var(h, axis=1, keepdims=True) + 1e-3
    )
    return jnp.mean((h - y) ** 2) + jnp.mean(p["b"] ** 2)


def _relu(p, x, y):
    return jnp.mean(jnp.maximum(x @ p["w"] + p["b"], 0.0) ** 2) + jnp.mean(jnp.abs(p["w"]))


def _leaky(p, x, y):
    h = x @ p["w"] + p["b"]
    return jnp.mean((jnp.where(h > 0, h, 0.1 * h) - y) ** 2)


def _remat(p, x, y):
    return jax.checkpoint(_mse)(p, x, y)


@jax.custom_vjp
def _softplus(h):
    return jnp.logaddexp(h, 0.0)


def _softplus_fwd(h):
    return _softplus(h), h


def _softplus_bwd(h, ct):
    return (ct * jax.nn.sigmoid(h),)


_softplus.defvjp(_softplus_fwd, _softplus_bwd)


def _custom_vjp(p, x, y):
    return jnp.mean(_softplus(x @ p["w"] + p["b"] - y))


def _scanned(p, x, y):
    def chunk(total, xy):
        return total + _mse(p, xy[0], xy[1]), None

    n = x.shape[0] // 2
    total, _ = jax.lax.scan(chunk, 0.0, (x.reshape(2, n, 3), y.reshape(2, n, 2)))
    return total / 2


def _branches(p, x, y):
    return jax.lax.cond(jnp.mean(x) > -10.0, _mse, _cross_entropy, p, x, y)


def _embedded(p, x, y):
    # rows of a table picked by integer ids: a gather, whose backward pass is a scatter-add
    ids = jnp.argmax(x, axis=1) % 3
    return jnp.mean((jnp.tanh(p["w"][ids] + p["b"]) - y) ** 2)


def _looped(p, x, y):
    n = x.shape[0] // 2

    def body(i, total):
        xi = jax.lax.dynamic_slice_in_dim(x, n * i, n)
        yi = jax.lax.dynamic_slice_in_dim(y, n * i, n)
        return total + _mse(p, xi, yi)

    return jax.lax.fori_loop(0, 2, body, 0.0) / 2


LOSSES = {
    "mse": _mse,
    "float16": _float16,
    "bfloat16": _bfloat16,
    "cross_entropy": _cross_entropy,
    "attention": _attention,
    "normed": _normed,
    "relu": _relu,
    "leaky": _leaky,
    "remat": _remat,
    "custom_vjp": _custom_vjp,
    "scan": _scanned,
    "cond": _branches,
    "fori": _looped,
    "embedding": _embedded,
}


# -- wirings: (loss, params, opt_state) -> the gradients given to update; and the reference -


def _scale(s):
    return lsj.get_loss_scale_state(s).scale


def _halves(a):
    return a[:4], a[4:]


def _penalized(loss, unscale):
    """PyTorch AMP's gradient-penalty recipe: the inner gradients of the scaled loss, unscaled
    (``unscale``), their norm added to the loss, the outer loss scaled."""

    def grads(p, s):
        def total(q):
            inner = jax.grad(lambda r: lsj.scale_loss(loss(r, X, Y), s))(q)
            return loss(q, X, Y) + 0.1 * unscale(inner, s)

        return jax.grad(lambda q: lsj.scale_loss(total(q), s))(p)

    return grads


def _norm(g):
    return jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree_util.tree_leaves(g)))


def _penalty_reference(loss, p):
    return jax.grad(lambda q: loss(q, X, Y) + 0.1 * _norm(jax.grad(loss)(q, X, Y)))(p)


def _maml(loss):
    def grads(p, s):
        def outer(q):
            inner = jax.grad(lambda r: lsj.scale_loss(loss(r, X[:4], Y[:4]), s))(q)
            adapted = jax.tree_util.tree_map(lambda a, g: a - 0.1 * g / _scale(s), q, inner)
            return lsj.scale_loss(loss(adapted, X[4:], Y[4:]), s)

        return jax.grad(outer)(p)

    return grads


def _maml_reference(loss, p):
    def outer(q):
        inner = jax.grad(loss)(q, X[:4], Y[:4])
        return loss(jax.tree_util.tree_map(lambda a, g: a - 0.1 * g, q, inner), X[4:], Y[4:])

    return jax.grad(outer)(p)


def _accumulate_scan(loss):
    def grads(p, s):
        def body(acc, xy):
            g = jax.grad(lambda q: lsj.scale_loss(loss(q, *xy), s))(p)
            return jax.tree_util.tree_map(jnp.add, acc, g), None

        zeros = jax.tree_util.tree_map(jnp.zeros_like, p)
        acc, _ = jax.lax.scan(body, zeros, (X.reshape(2, 4, 3), Y.reshape(2, 4, 2)))
        return jax.tree_util.tree_map(lambda a: a / 2, acc)

    return grads


def _accumulate_fori(loss):
    def grads(p, s):
        def body(i, acc):
            xi = jax.lax.dynamic_slice_in_dim(X, 4 * i, 4)
            yi = jax.lax.dynamic_slice_in_dim(Y, 4 * i, 4)
            g = jax.grad(lambda q: lsj.scale_loss(loss(q, xi, yi), s))(p)
            return jax.tree_util.tree_map(jnp.add, acc, g)

        acc = jax.lax.fori_loop(0, 2, body, jax.tree_util.tree_map(jnp.zeros_like, p))
        return jax.tree_util.tree_map(lambda a: a / 2, acc)

    return grads


def _halves_reference(loss, p):
    gs = [jax.grad(loss)(p, x, y) for x, y in zip(_halves(X), _halves(Y), strict=True)]
    return jax.tree_util.tree_map(lambda a, b: (a + b) / 2, *gs)


def _per_example(loss):
    def grads(p, s):
        per = jax.vmap(
            jax.grad(lambda q, x, y: lsj.scale_loss(loss(q, x.reshape(2, 3), y.reshape(2, 2)), s)),
            in_axes=(None, 0, 0),
        )(p, X.reshape(4, 6), Y.reshape(4, 4))
        return jax.tree_util.tree_map(lambda g: jnp.mean(g, axis=0), per)

    return grads


def _per_example_reference(loss, p):
    gs = [jax.grad(loss)(p, X[2 * i : 2 * i + 2], Y[2 * i : 2 * i + 2]) for i in range(4)]
    return jax.tree_util.tree_map(lambda *a: sum(a) / 4, *gs)


def _plain_reference(loss, p):
    return jax.grad(loss)(p, X, Y)


def _guarded(loss):
    def grads(p, s):
        def scaled(q):
            value = lsj.scale_loss(loss(q, X, Y), s)
            return jnp.where(jnp.isfinite(value), value, 0.0)

        return jax.grad(scaled)(p)

    return grads


WIRINGS = {
    "scale_loss": (
        lambda loss: lambda p, s: jax.grad(lambda q: lsj.scale_loss(loss(q, X, Y), s))(p),
        _plain_reference,
    ),
    "value_and_grad": (
        lambda loss: lambda p, s: lsj.value_and_grad(functools.partial(loss, x=X, y=Y), s)(p)[1],
        _plain_reference,
    ),
    "by_hand": (
        lambda loss: lambda p, s: jax.grad(lambda q: loss(q, X, Y) * _scale(s))(p),
        _plain_reference,
    ),
    "vjp_seeded": (
        lambda loss: lambda p, s: jax.vjp(lambda q: loss(q, X, Y), p)[1](_scale(s))[0],
        _plain_reference,
    ),
    "cancelling": (  # the scaled loss times the scale squared, divided by it twice
        lambda loss: (
            lambda p, s: jax.grad(
                lambda q: (
                    lsj.scale_loss(loss(q, X, Y), s) * _scale(s) ** 2 / (_scale(s) * _scale(s))
                )
            )(p)
        ),
        _plain_reference,
    ),
    "penalty_by_hand": (
        lambda loss: _penalized(
            loss, lambda g, s: _norm(jax.tree_util.tree_map(lambda x: x / _scale(s), g))
        ),
        _penalty_reference,
    ),
    "penalty_unscale": (
        lambda loss: _penalized(loss, lambda g, s: _norm(lsj.unscale(g, _scale(s)))),
        _penalty_reference,
    ),
    "penalty_unscaled_global_norm": (
        lambda loss: _penalized(loss, lsj.unscaled_global_norm),
        _penalty_reference,
    ),
    "maml": (_maml, _maml_reference),
    "accumulate_scan": (_accumulate_scan, _halves_reference),
    "accumulate_fori": (_accumulate_fori, _halves_reference),
    "per_example_vmap": (_per_example, _per_example_reference),
    "jit_inside": (
        lambda loss: lambda p, s: jax.grad(jax.jit(lambda q: lsj.scale_loss(loss(q, X, Y), s)))(p),
        _plain_reference,
    ),
    "remat_around": (
        lambda loss: (
            lambda p, s: jax.grad(jax.checkpoint(lambda q: lsj.scale_loss(loss(q, X, Y), s)))(p)
        ),
        _plain_reference,
    ),
    "where_guard": (_guarded, _plain_reference),
}

# Each wiring runs over 8 of the 14 losses, a window that moves by one loss from wiring to
# wiring: every loss meets 7 to 9 wirings (the whole product, 210, takes 1.7 times as long
# for no pattern more). The per-example wiring skips the losses that
# split the batch in halves (it gives them 2 rows).
_PER_WIRING = 8
_NOT_PER_EXAMPLE = {"scan", "fori"}
_NAMES = list(LOSSES)
CASES = [
    (w, _NAMES[(i + j) % len(_NAMES)])
    for i, w in enumerate(WIRINGS)
    for j in range(_PER_WIRING)
    if not (w == "per_example_vmap" and _NAMES[(i + j) % len(_NAMES)] in _NOT_PER_EXAMPLE)
]


def _tolerance(loss):
    return {"float16": 1e-2, "bfloat16": 5e-2}.get(loss, 1e-4)


def test_the_corpus_holds_at_least_100_right_wirings():
    assert len(CASES) >= 100


@pytest.mark.slow
@pytest.mark.parametrize(("wiring", "loss"), CASES)
def test_a_right_wiring_trains_right_and_sees_nothing(wiring, loss):
    make, reference = WIRINGS[wiring]
    grads_fn = make(LOSSES[loss])
    tx = lsj.loss_scaling(optax.sgd(LR), lsj.DynamicScale(init_scale=SCALE))

    @jax.jit
    def step(params, opt_state):
        return tx.update(grads_fn(params, opt_state), opt_state, params)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a WiringWarning fails the test too
        updates, state = step(PARAMS, tx.init(PARAMS))
    assert not bool(lsj.metrics(state)["skipped"])
    want = reference(LOSSES[loss], PARAMS)
    rtol = _tolerance(loss)
    for k in want:
        np.testing.assert_allclose(
            np.asarray(updates[k]), -LR * np.asarray(want[k]), rtol=rtol, atol=rtol * 1e-2
        )


def test_wgan_gp_written_as_pytorch_amp_does():
    # The critic's gradient with respect to its input, of the scaled critic output, unscaled
    # by hand; the penalty (||g|| - 1)^2 added; the outer loss scaled (PyTorch AMP's recipe).
    def critic(p, x):
        return jnp.tanh(x @ p["w"] + p["b"]).sum(axis=1)

    def objective(p, input_grad):
        norms = jnp.sqrt(jnp.sum(input_grad**2, axis=1))
        return jnp.mean(critic(p, X)) + 10.0 * jnp.mean((norms - 1.0) ** 2)

    def grads(p, s):
        def total(q):
            scaled_gx = jax.grad(lambda x: lsj.scale_loss(jnp.sum(critic(q, x)), s))(X)
            return objective(q, scaled_gx / _scale(s))

        return jax.grad(lambda q: lsj.scale_loss(total(q), s))(p)

    tx = lsj.loss_scaling(optax.sgd(LR), lsj.DynamicScale(init_scale=SCALE))
    step = jax.jit(lambda p, s: tx.update(grads(p, s), s, p))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        updates, _ = step(PARAMS, tx.init(PARAMS))
    want = jax.grad(lambda q: objective(q, jax.grad(lambda x: jnp.sum(critic(q, x)))(X)))(PARAMS)
    for k in want:
        np.testing.assert_allclose(updates[k], -LR * want[k], rtol=1e-4, atol=1e-6)


# -- wrong wirings: refused or warned, with what was found ----------------------------------


def _mse32(p, x=X, y=Y):
    return _mse(p, x, y)


def _l2(p):
    return 0.01 * jnp.sum(p["w"] ** 2)


def _grads_times_scale(p, s):
    g = jax.grad(lambda q: lsj.scale_loss(_mse32(q), s))(p)
    return jax.tree_util.tree_map(lambda x: x * _scale(s), g)


def _unscaled_by_hand(p, s):
    g = jax.grad(lambda q: lsj.scale_loss(_mse32(q), s))(p)
    return jax.tree_util.tree_map(lambda x: x / _scale(s), g)


def _unscaled_with_unscale(p, s):
    return lsj.unscale(jax.grad(lambda q: lsj.scale_loss(_mse32(q), s))(p), _scale(s))


def _unscaled_and_checked(p, s):
    g = jax.grad(lambda q: lsj.scale_loss(_mse32(q), s))(p)
    return lsj.unscale_and_check(g, _scale(s))[0]


def _one_term_scaled(p, s):
    return jax.grad(lambda q: lsj.scale_loss(_mse32(q), s) + _l2(q))(p)


def _other_term_scaled(p, s):
    return jax.grad(lambda q: _mse32(q) + lsj.scale_loss(_l2(q), s))(p)


def _remat_scaled_twice(p, s):
    return jax.grad(jax.checkpoint(lambda q: lsj.scale_loss(_mse32(q) * _scale(s), s)))(p)


def _divided_after_scaling(p, s):
    return jax.grad(lambda q: lsj.scale_loss(_mse32(q), s) / _scale(s))(p)


def _scaled_after_backward(p, s):
    return jax.tree_util.tree_map(lambda g: g * _scale(s), jax.grad(_mse32)(p))


WRONG = {
    # name: (grads_fn, WiringError or WiringWarning, what the message says, the update's
    #        ratio to the right one with the check off, at the scale 2**12)
    "gradients multiplied by the scale after grad": (
        _grads_times_scale,
        WiringError,
        r"to the power 2 .* too large by the scale",
        2.0**12,
    ),
    "unscaled by hand, then update": (
        _unscaled_by_hand,
        WiringError,
        r"to the power 0 .* divided out again .* too small by the scale",
        2.0**-12,
    ),
    "unscaled with lsj.unscale, then update": (
        _unscaled_with_unscale,
        WiringError,
        r"to the power 0 .* divided out again .* too small by the scale",
        2.0**-12,
    ),
    "unscaled with lsj.unscale_and_check, then update": (
        _unscaled_and_checked,
        WiringError,
        r"to the power 0 .* divided out again .* too small by the scale",
        2.0**-12,
    ),
    "scale_loss(mse) + l2": (
        _one_term_scaled,
        WiringError,
        r"different powers .*powers seen: 0, 1\).* a part of the loss was multiplied",
        None,  # mixed: l2's part 1/4096, mse's right
    ),
    "mse + scale_loss(l2)": (
        _other_term_scaled,
        WiringError,
        r"different powers .*powers seen: 0, 1\)",
        None,
    ),
    "checkpoint around scale_loss(loss * scale)": (
        _remat_scaled_twice,
        WiringError,
        r"to the power 2 .* too large by the scale",  # the remat's program interpreted
        2.0**12,
    ),
    "scale_loss(loss) / scale": (
        _divided_after_scaling,
        WiringError,
        r"to the power 0 .* too small by the scale",
        2.0**-12,
    ),
    "unscaled backward, multiplied by the scale after": (
        _scaled_after_backward,
        WiringWarning,
        r"once, but the scale reached it .* after the backward pass .* size of every update is"
        r" right",
        1.0,
    ),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_a_wrong_wiring_is_refused_or_warned_with_what_was_found(name):
    grads_fn, kind, message, ratio = WRONG[name]
    tx = lsj.loss_scaling(optax.sgd(LR), lsj.DynamicScale(init_scale=2.0**12))

    def step(params, opt_state):
        return tx.update(grads_fn(params, opt_state), opt_state, params)

    with lsj.no_wiring_check():  # what the step does without the check
        updates, _ = jax.jit(lambda *a: step(*a))(PARAMS, tx.init(PARAMS))
    want = jax.grad(_mse32)(PARAMS)
    if ratio is not None:
        for k in want:
            np.testing.assert_allclose(
                np.asarray(updates[k]), -LR * ratio * np.asarray(want[k]), rtol=1e-4
            )
    else:  # one term scaled, one not: each update is off from the right one's
        right = jax.grad(lambda q: _mse32(q) + _l2(q))(PARAMS)
        assert not np.allclose(np.asarray(updates["w"]), -LR * np.asarray(right["w"]), rtol=1e-2)
    if kind is WiringError:
        with pytest.raises(WiringError, match=message) as e:
            jax.jit(lambda *a: step(*a))(PARAMS, tx.init(PARAMS))
        text = str(e.value)
    else:
        with pytest.warns(WiringWarning, match=message) as seen:
            jax.jit(lambda *a: step(*a))(PARAMS, tx.init(PARAMS))
        text = str(seen[0].message)
    # every message names both off switches
    assert "loss_scaling(..., check_wiring=False)" in text
    assert "lsj.no_wiring_check()" in text


# -- the off switches ---------------------------------------------------------------------


def _unscaled_step(tx):
    return jax.jit(lambda p, s: tx.update(jax.grad(_mse32)(p), s, p))


def test_check_wiring_false_turns_the_check_off_for_one_transformation():
    on = lsj.loss_scaling(optax.sgd(LR), lsj.DynamicScale())
    off = lsj.loss_scaling(optax.sgd(LR), lsj.DynamicScale(), check_wiring=False)
    with pytest.raises(WiringError, match="check_wiring=False"):
        _unscaled_step(on)(PARAMS, on.init(PARAMS))
    updates, _ = _unscaled_step(off)(PARAMS, off.init(PARAMS))  # refused above, not here
    want = jax.grad(_mse32)(PARAMS)
    np.testing.assert_allclose(updates["w"], -LR * want["w"] / 2.0**15, rtol=1e-5)
    acc = lsj.loss_scaling_multi_steps(
        optax.sgd(LR), lsj.DynamicScale(), every_k=2, check_wiring=False
    )
    _unscaled_step(acc)(PARAMS, acc.init(PARAMS))
    acc_on = lsj.loss_scaling_multi_steps(optax.sgd(LR), lsj.DynamicScale(), every_k=2)
    with pytest.raises(WiringError, match=r"loss_scaling_multi_steps\(\.\.\., check_wiring=False"):
        _unscaled_step(acc_on)(PARAMS, acc_on.init(PARAMS))


def test_no_wiring_check_turns_it_off_for_a_block_and_only_there():
    tx = lsj.loss_scaling(optax.sgd(LR), lsj.DynamicScale())
    with lsj.no_wiring_check():
        _unscaled_step(tx)(PARAMS, tx.init(PARAMS))
        with lsj.no_wiring_check():  # nested blocks
            _unscaled_step(tx)(PARAMS, tx.init(PARAMS))
        _unscaled_step(tx)(PARAMS, tx.init(PARAMS))
    with pytest.raises(WiringError):  # on again after the block
        _unscaled_step(tx)(PARAMS, tx.init(PARAMS))


def test_check_wiring_must_be_a_bool():
    with pytest.raises(TypeError, match="check_wiring must be True or False, got 'no'"):
        lsj.loss_scaling(optax.sgd(LR), lsj.DynamicScale(), check_wiring="no")


def test_the_penalty_recipe_program_is_the_same_with_and_without_the_check():
    make, _ = WIRINGS["penalty_unscale"]
    grads_fn = make(_mse)
    tx = lsj.loss_scaling(optax.sgd(LR), lsj.DynamicScale(init_scale=SCALE))

    def step(params, opt_state):
        return tx.update(grads_fn(params, opt_state), opt_state, params)

    with_check = str(jax.make_jaxpr(step)(PARAMS, tx.init(PARAMS)))
    with lsj.no_wiring_check():
        without = str(jax.make_jaxpr(step)(PARAMS, tx.init(PARAMS)))
    assert with_check == without


def test_the_benchmarks_gpt_step_is_right_and_the_benchmark_runs():
    # benchmarks/bench_wiring.py at a tiny size, warnings as errors: its GPT (an embedding's
    # gather, attention, layer norms, GELU) is a right wiring, and the benchmark prints its
    # ratio.
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_wiring.py"
    out = subprocess.run(
        [sys.executable, "-W", "error", str(script), "--rounds", "1", "--layers", "1"]
        + ["--width", "64"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "on / off:" in out.stdout and "GPT 0.6M params" in out.stdout
