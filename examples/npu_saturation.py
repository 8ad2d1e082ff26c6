"""Saturation mode, emulated on CPU: the IEEE check misses what a saturating check sees.

On an Ascend NPU in saturation mode a float16 overflow writes ±65504 instead of inf (and
nan becomes 0). ``lsj.testing.saturating`` evaluates the gradient function that way on
any host. A small float16 MLP (float32 master weights, momentum SGD) starts with a loss
scale of 2**24, far too large: its scaled gradients overflow. Four runs see the same
data:

- ``IEEE device, ieee``: the reference. The first steps overflow (inf), are skipped and
  the scale backs off until the gradients fit; then it trains.
- ``saturating, ieee``: the gradients hold ±65504 instead of inf, the inf/nan check sees
  nothing, no step is skipped, the scale never backs off and the clamped gradients
  (``65504 / scale`` at most) barely move the weights: training lags far behind.
- ``saturating, saturating`` and ``saturating, both``: ``|g| >= 65504`` is caught, the
  same steps are skipped, the scale backs off the same way and training follows the
  reference step for step (the loss to float16 rounding: the two programs are compiled
  apart and may round intermediates differently), until a step where IEEE hardware
  computes a gradient of exactly 65504 (values in [65504, 65520) round to 65504, not to
  inf): the saturating check skips it too, the IEEE check does not, and from there the
  two runs differ a little while training equally well.

Run: ``python examples/npu_saturation.py``
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lossscale_jax as lsj

IN, HIDDEN = 16, 32  # MLP sizes: IN -> HIDDEN (tanh) -> 1
BATCH = 64
STEPS = 200
EVAL = 256  # held-out samples the loss is reported on
INIT_SCALE = 2.0**24  # far too large for float16: the first gradients overflow
GROWTH_INTERVAL = 20
LR, MOMENTUM = 0.05, 0.9
SEED = 0

RUNS = (  # (label, emulate saturation, overflow check)
    ("IEEE device, ieee", False, "ieee"),
    ("saturating, ieee", True, "ieee"),
    ("saturating, saturating", True, "saturating"),
    ("saturating, both", True, "both"),
)


def make_data(steps: int, batch: int, seed: int = SEED):
    """Inputs and targets of a random teacher MLP: ``steps`` batches, a held-out set."""
    rng = np.random.default_rng(seed)
    w1 = rng.normal(size=(IN, HIDDEN)) / np.sqrt(IN)
    w2 = rng.normal(size=(HIDDEN, 1)) * 3.0 / np.sqrt(HIDDEN)
    x = rng.normal(size=(steps * batch + EVAL, IN))
    y = np.tanh(x @ w1) @ w2
    x, y = x.astype(np.float32), y.astype(np.float32)
    train = (x[:-EVAL].reshape(steps, batch, IN), y[:-EVAL].reshape(steps, batch, 1))
    return train, (x[-EVAL:], y[-EVAL:])


def init_params(seed: int = SEED + 1) -> dict[str, jax.Array]:
    """float32 master weights."""
    rng = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(rng.normal(size=(IN, HIDDEN)) / np.sqrt(IN), jnp.float32),
        "b1": jnp.zeros(HIDDEN, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(HIDDEN, 1)) / np.sqrt(HIDDEN), jnp.float32),
        "b2": jnp.zeros(1, jnp.float32),
    }


def loss_fn(params, x, y):
    """Mean squared error; the MLP computes in ``params``' dtype, the loss in fp32."""
    dtype = params["w1"].dtype
    h = jnp.tanh(x.astype(dtype) @ params["w1"] + params["b1"])
    pred = (h @ params["w2"] + params["b2"]).astype(jnp.float32)
    return jnp.mean((pred - y.astype(jnp.float32)) ** 2)


def make_tx(overflow: str) -> optax.GradientTransformationExtraArgs:
    policy = lsj.DynamicScale(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    return lsj.loss_scaling(optax.sgd(LR, momentum=MOMENTUM), policy, overflow=overflow)


def gradient_fn(emulate_saturation: bool):
    """``grad(scaled loss)`` w.r.t. the float16 params; saturating (an NPU) if asked."""

    def scaled_loss(p16, opt_state, x, y):
        return lsj.scale_loss(loss_fn(p16, x, y), opt_state)

    grad = jax.grad(scaled_loss)
    return lsj.testing.saturating(grad) if emulate_saturation else grad


def train(
    emulate_saturation: bool, overflow: str, data, eval_data
) -> dict[str, np.ndarray]:
    """Trains from the same start on ``data``; per step: eval loss, scale, skipped."""
    tx = make_tx(overflow)
    grad = gradient_fn(emulate_saturation)

    def step(carry, batch):
        params, opt_state = carry
        p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), params)
        grads = grad(p16, opt_state, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        m = lsj.metrics(opt_state)
        return (params, opt_state), (
            loss_fn(params, *eval_data),
            m["loss_scale"],
            m["skipped"],
        )

    @jax.jit
    def run(params, data):
        _, out = jax.lax.scan(step, (params, tx.init(params)), data)
        return out

    loss, scale, skipped = jax.device_get(run(init_params(), data))
    return {"loss": loss, "scale": scale, "skipped": skipped}


def main(steps: int = STEPS, batch: int = BATCH, every: int = 10) -> dict[str, dict]:
    """Runs the four configurations and prints their trajectories side by side."""
    start = time.perf_counter()
    data, eval_data = make_data(steps, batch)
    results = {label: train(sat, mode, data, eval_data) for label, sat, mode in RUNS}

    print(f"float16 MLP, DynamicScale(init_scale=2**24), momentum SGD, {steps} steps")
    print(
        "device / overflow check; per column: held-out loss, log2(scale), "
        "s = step skipped\n"
    )
    # Two header lines: the device, then the check (the labels are "device, check").
    devices = [label.split(", ")[0] for label in results]
    checks = [label.split(", ")[1] + " check" for label in results]
    print("step " + "".join(f"| {d:<17}" for d in devices).rstrip())
    print("     " + "".join(f"| {c:<17}" for c in checks).rstrip())
    rows = sorted({*range(min(12, steps)), *range(0, steps, every), steps - 1})
    for i in rows:
        cells = []
        for r in results.values():
            mark = "s" if r["skipped"][i] else " "
            cells.append(
                f"| {r['loss'][i]:7.4f} 2^{np.log2(r['scale'][i]):<3.0f} {mark}  "
            )
        print((f"{i:4d} " + "".join(cells)).rstrip())
    print()
    ref = results[RUNS[0][0]]
    for label, r in results.items():
        differ = np.nonzero(r["skipped"] != ref["skipped"])[0]
        same = (
            f"first skip decision unlike the IEEE device's: step {differ[0]}"
            if differ.size
            else "skips as on the IEEE device"
        )
        print(
            f"{label:<24} skipped {int(r['skipped'].sum()):3d}   final scale "
            f"2^{np.log2(r['scale'][-1]):<3.0f} final loss {r['loss'][-1]:.4f}"
        )
        print(f"{'':<24} {same}")
    print(f"\n({time.perf_counter() - start:.1f} s)")
    return results


if __name__ == "__main__":
    main()
