"""The skip's two formulations, the conditional and the select, step for step on XLA:CPU.

On XLA:CPU a select's good branch is fenced off as the conditional's is
(``engine/_skip.py``: ``fenced``), so the two give the same bits on every step with the
optimizers people train with (Adam, AdamW, SGD with momentum), on the Optax path, the fused
step and over accumulation windows, from the backward pass to the update in one ``jit``: a
run saved under one and resumed under the other continues bit for bit. That holds where the
fences survive fusion (``barriers_survive_fusion``: jaxlib 0.12). Where XLA:CPU expands them
before fusion (jaxlib 0.10) it fuses across them and contracts a multiply with the add after
it differently in each program: each step is then within one ulp of the larger of a
parameter's old and new values of the other's from the same state (two over a window, where
the mean is fused in as well), and runs drift apart. ``layerwise_scaling`` without
accumulation keeps a difference even with the fences (a layout copy fused into its moment
kernels under the select): the same per-step bound. docs/reliability.md (checkpoints) says so.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_step_within_ulps, barriers_survive_fusion, bits, mlp_step
from helpers import mlp_params as params_of

import lossscale_jax as lsj
from lossscale_jax.engine import _skip

# Not slow-marked but the run across formulations and the per-layer step: the fast tier on the
# floor (jaxlib 0.10) holds the per-step bound, the newest the bits.
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's programs")
FENCED = barriers_survive_fusion()
INNERS = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
}
FRONTS = ("optax", "fused", "window_3")


def batches(n, bad_at=2):
    rng = np.random.default_rng(1)
    out = []
    for t in range(n):
        x = rng.normal(size=(16, 32))
        if t == bad_at:
            x[0, 0] = np.inf  # a skipped step (a window, with accumulation)
        out.append(
            (jnp.asarray(x, jnp.float16), jnp.asarray(rng.normal(size=(16, 8)), jnp.float16))
        )
    return out


def make_step(front, inner, formulation):
    """The README's step, backward pass and update in one jit, traced under ``formulation``."""
    if front == "window_3":
        tx = lsj.loss_scaling_multi_steps(inner, lsj.DynamicScale(init_scale=2.0**10), 3)
    else:
        tx = lsj.loss_scaling(inner, lsj.DynamicScale(init_scale=2.0**10))

    step = mlp_step(tx, fused=front == "fused")

    with _skip.formulation(formulation):
        jitted = jax.jit(step)
        jitted.lower(params_of(), tx.init(params_of()), *batches(1)[0])  # traced here
    return tx, jitted


def run(step, carry, data):
    for x, y in data:
        carry = step(*carry, x, y)
    return carry


def ulps(front):
    return 2 if front == "window_3" else 1


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_the_two_formulations_step_alike(inner, front):
    tx, cond = make_step(front, INNERS[inner](), "cond")
    _, select = make_step(front, INNERS[inner](), "select")
    carry = (params_of(), tx.init(params_of()))
    for x, y in batches(7):
        a, b = cond(*carry, x, y), select(*carry, x, y)  # one step from the same state
        if FENCED:
            assert bits(a) == bits(b)
        else:
            assert_step_within_ulps(b, a, (carry[0], a[1]), ulps(front), f"{inner}/{front}")
        carry = a
    assert not bool(jnp.all(carry[0]["w0"] == params_of()["w0"]))  # it trained


@pytest.mark.slow
@pytest.mark.parametrize("front", FRONTS)
def test_a_run_resumes_under_the_other_formulation(front):
    # Saved after 4 steps under the conditional (a skipped one among them), resumed for 5
    # under the select: where the fences hold, the same bits as 9 steps under the conditional.
    tx, cond = make_step(front, INNERS["adam"](), "cond")
    _, select = make_step(front, INNERS["adam"](), "select")
    data = batches(9)
    saved = run(cond, (params_of(), tx.init(params_of())), data[:4])
    whole = run(cond, saved, data[4:])
    resumed = run(select, saved, data[4:])
    if FENCED:
        assert bits(resumed) == bits(whole)
    else:  # the runs drift apart: each step's bound holds (above), not the whole run's
        pytest.skip("this XLA:CPU expands optimization barriers before fusion (jaxlib 0.10)")


@pytest.mark.slow
def test_layerwise_without_accumulation_steps_within_an_ulp():
    # The exception with the fences: a layout copy fused into the moment kernels under the
    # select. Each step from the same state within one ulp of the parameters.
    def tapped_loss(p, x, y):
        p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), p)
        h = lsj.tap(jax.nn.relu(x @ p16["w0"] + p16["b0"]), "h")
        return jnp.mean((h @ p16["w1"] - y) ** 2).astype(jnp.float32)

    x0, y0 = batches(1)[0]
    layers = lsj.layerwise.discover(tapped_loss, params_of(), x0, y0)
    tx = lsj.layerwise_scaling(optax.adam(1e-3), layers)

    def step(params, state, x, y):
        scaled = lambda p: lsj.scale_loss(tapped_loss(p, x, y), state)  # noqa: E731
        _, grads, taps = lsj.layerwise.value_and_grad(scaled, layers, state)(params)
        return lsj.apply_gradients(tx, grads, state, params, taps=taps)

    steps = {}
    for name in ("cond", "select"):
        with _skip.formulation(name):
            steps[name] = jax.jit(step)
            steps[name].lower(params_of(), tx.init(params_of()), x0, y0)
    carry = (params_of(), tx.init(params_of()))
    for x, y in batches(5):
        a, b = steps["cond"](*carry, x, y), steps["select"](*carry, x, y)
        assert_step_within_ulps(b[0], a[0], carry[0], 1, "layerwise params")
        carry = a
