"""An Equinox model with BatchNorm trained in float16: loss scaling, its state, and mpx.

An Equinox regression network (``Linear -> BatchNorm -> relu -> Linear``: a Module whose
BatchNorm keeps running statistics in an ``eqx.nn.State``) learns a random teacher. Its
loss is weighted by ``2**-20`` (as an auxiliary loss might be), so its float16 gradients
fall below float16's range, and two batches hold a corrupt sample (an inf input). Five
runs see the same batches and report the held-out loss, computed with the running
statistics (``eqx.nn.inference_mode``):

- ``float32``: the reference. The corrupt batches' gradients are nan: the step is
  skipped (``lsj.NoScale(skip_on_overflow=True)``) and BatchNorm keeps its state.
- ``no scale``: float16 compute without a loss scale: many gradients underflow to
  zero and the network falls behind.
- ``dynamic``: float16, ``lsj.loss_scaling`` with ``lsj.DynamicScale()`` and the fused
  step (``lsj.apply_gradients``); it follows the reference.
- ``state lost``: the same, taking BatchNorm's new state from every forward pass:
  the corrupt batch writes nan into the running statistics, and every later held-out
  loss is nan, although the skipped step left the weights untouched.
- ``compat.mpx``: the training step of mpx (``mixed-precision-for-jax``),
  ``mpx.filter_value_and_grad`` and ``mpx.optimizer_update``, with ``compat.mpx``
  imported in place of ``mpx``; the state is kept with ``mpx.select_tree`` on skipped
  steps. It trains like the library's step (its scale starts at mpx's ``FLOAT16_MAX``).

Run: ``python examples/train_equinox.py``
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import lossscale_jax as lsj
from lossscale_jax.compat import mpx

IN, HIDDEN = 16, 64
BATCH = 64
STEPS = 300
EVAL = 512  # held-out samples
LOSS_WEIGHT = (
    2.0**-20
)  # small enough that float16's gradients underflow without a scale
CORRUPT = (60, 170)  # steps whose batch holds an inf input
LR = 1e-2
SEED = 0


class Net(eqx.Module):
    """``Linear -> BatchNorm -> relu -> Linear``; BatchNorm computes in float32."""

    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    head: eqx.nn.Linear
    activation: object  # a function, not an array: no gradient, no update

    def __init__(self, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.linear = eqx.nn.Linear(IN, HIDDEN, use_bias=False, key=k1)
        self.norm = eqx.nn.BatchNorm(HIDDEN, axis_name="batch", mode="batch")
        self.head = eqx.nn.Linear(HIDDEN, 1, key=k2)
        self.activation = jax.nn.relu

    def __call__(self, x: jax.Array, state: eqx.nn.State):
        h = self.linear(x)
        n, state = self.norm(h.astype(jnp.float32), state)
        return self.head(self.activation(n).astype(x.dtype)), state


def cast(tree, dtype):
    """The floating arrays of ``tree`` in ``dtype``; everything else as it is."""
    return jax.tree_util.tree_map(
        lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, tree
    )


def make_data(steps: int, batch: int, seed: int = SEED):
    """Batches of a random tanh teacher (two of them corrupt) and a held-out set."""
    rng = np.random.default_rng(seed)
    w1 = rng.normal(size=(IN, HIDDEN)) / np.sqrt(IN)
    w2 = rng.normal(size=(HIDDEN, 1)) / np.sqrt(HIDDEN)
    x = rng.normal(size=(steps * batch + EVAL, IN))
    y = np.tanh(x @ w1) @ w2
    x, y = x.astype(np.float32), y.astype(np.float32)
    xs, ys = x[:-EVAL].reshape(steps, batch, IN), y[:-EVAL].reshape(steps, batch, 1)
    for step in CORRUPT:
        if step < steps:
            xs[step, 0, 0] = np.inf
    return (xs, ys), (x[-EVAL:], y[-EVAL:])


def forward(model, state, x):
    """The network over a batch (BatchNorm's statistics over it), and the new state."""
    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    return batched(x, state)


def loss_of(model, state, x, y):
    """Mean squared error in float32 and BatchNorm's new state."""
    pred, state = forward(model, state, x.astype(model.head.weight.dtype))
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2), state


@eqx.filter_jit
def held_out(model, state, x, y):
    """The held-out loss with the running statistics (inference mode)."""
    return loss_of(eqx.nn.inference_mode(model), state, x, y)[0]


def train_lsj(dtype, policy, keep_state: bool, data, eval_data):
    """The library's step: ``lsj.scale_loss``, ``eqx.filter_grad``, the fused step."""
    model, state = eqx.nn.make_with_state(Net)(jax.random.key(SEED))
    params, static = eqx.partition(model, eqx.is_array)
    tx = lsj.loss_scaling(optax.adam(LR), policy)
    opt_state = tx.init(params)

    @eqx.filter_jit
    def step(params, state, opt_state, x, y):
        def scaled_loss(p):
            loss, new_state = loss_of(eqx.combine(p, static), state, x, y)
            return lsj.scale_loss(loss * LOSS_WEIGHT, opt_state), new_state

        grads, new_state = eqx.filter_grad(scaled_loss, has_aux=True)(
            cast(params, dtype)
        )
        params, opt_state = lsj.apply_gradients(tx, grads, opt_state, params)
        m = lsj.metrics(opt_state)
        if keep_state:  # a skipped step's forward pass may have written inf or nan
            new_state = lsj.rollback_if_skipped(opt_state, state, new_state)
        return params, new_state, opt_state, m["loss_scale"], m["skipped"]

    rows = []
    for x, y in zip(*data, strict=True):
        params, state, opt_state, scale, skipped = step(params, state, opt_state, x, y)
        loss = held_out(eqx.combine(params, static), state, *eval_data)
        rows.append((float(loss), float(scale), bool(skipped)))
    return rows


def train_mpx(data, eval_data):
    """mpx's training step (its README), with ``compat.mpx`` in place of ``mpx``."""
    model, state = eqx.nn.make_with_state(Net)(jax.random.key(SEED))
    optimizer = optax.adam(LR)
    optimizer_state = optimizer.init(eqx.filter(model, eqx.is_array))
    loss_scaling = mpx.DynamicLossScaling(
        loss_scaling=mpx.FLOAT16_MAX,
        min_loss_scaling=jnp.ones((), dtype=jnp.float32),
        period=2000,
    )

    @eqx.filter_jit
    def make_step(model, state, optimizer_state, loss_scaling, x, y):
        # mpx casts the arguments to float16; the state, float32, comes in from outside.
        def loss_fn(model, x, y):
            loss, new_state = loss_of(model, state, x, y)
            return loss * LOSS_WEIGHT, new_state

        (_, new_state), loss_scaling, grads_finite, grads = mpx.filter_value_and_grad(
            loss_fn, scaling=loss_scaling, has_aux=True
        )(model, x, y)
        model, optimizer_state = mpx.optimizer_update(
            model, optimizer, optimizer_state, grads, grads_finite
        )
        state = mpx.select_tree(grads_finite, new_state, state)  # kept on a skip
        return model, state, optimizer_state, loss_scaling, grads_finite

    rows = []
    for x, y in zip(*data, strict=True):
        model, state, optimizer_state, loss_scaling, finite = make_step(
            model, state, optimizer_state, loss_scaling, x, y
        )
        loss = held_out(model, state, *eval_data)
        rows.append((float(loss), float(loss_scaling.loss_scaling), not bool(finite)))
    return rows


RUNS = {  # label: (compute dtype, policy, keep BatchNorm's state on a skipped step)
    "float32": (jnp.float32, lsj.NoScale(skip_on_overflow=True), True),
    "no scale": (jnp.float16, lsj.NoScale(skip_on_overflow=True), True),
    "dynamic": (jnp.float16, lsj.DynamicScale(), True),
    "state lost": (jnp.float16, lsj.DynamicScale(), False),
}
MPX = "compat.mpx"


def main(steps: int = STEPS, batch: int = BATCH, every: int = 30) -> dict[str, list]:
    """Runs the five configurations and prints their held-out losses side by side.

    Returns ``{label: [(held-out loss, loss scale, skipped) per step]}``.
    """
    start = time.perf_counter()
    data, eval_data = make_data(steps, batch)
    results = {
        label: train_lsj(dtype, policy, keep, data, eval_data)
        for label, (dtype, policy, keep) in RUNS.items()
    }
    results[MPX] = train_mpx(data, eval_data)

    corrupt = ", ".join(str(c) for c in CORRUPT if c < steps)
    print(f"Equinox Linear-BatchNorm-relu-Linear, Adam, {steps} steps")
    print(
        f"loss weighted by 2**{np.log2(LOSS_WEIGHT):.0f}; inf inputs at steps {corrupt}"
    )
    print("float16 runs: no scale, dynamic, state lost, compat.mpx (mpx's step)")
    print("held-out loss (BatchNorm's running statistics); s = step skipped\n")
    print("step " + "".join(f"| {label:<12}" for label in results).rstrip())
    marks = set(range(0, steps, every)) | {c + d for c in CORRUPT for d in (-1, 0, 1)}
    for i in sorted(m for m in marks | {steps - 1} if 0 <= m < steps):
        cells = []
        for rows in results.values():
            loss, _, skipped = rows[i]
            cells.append(f"| {loss:8.4f} {'s' if skipped else ' '}  ")
        print((f"{i:4d} " + "".join(cells)).rstrip())
    print()
    for label, rows in results.items():
        print(
            f"{label:<11} skipped {sum(r[2] for r in rows):2d}   final scale "
            f"{rows[-1][1]:7.0f}   final held-out loss {rows[-1][0]:.4f}"
        )
    print(f"\n({time.perf_counter() - start:.1f} s)")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    main(steps=args.steps)
