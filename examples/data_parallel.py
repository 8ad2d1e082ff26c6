"""Data-parallel loss scaling on 8 CPU devices: all devices take one skip decision.

The same float16 model is trained twice, with ``jax.pmap`` and with ``jax.shard_map``,
on 8 (fake) CPU devices. Now and then one device is fed a poisoned batch (an inf in its
input), so only that device's gradients overflow. ``loss_scaling(...,
axis_name="batch")`` ORs the overflow flag over the devices with one scalar all-reduce
before deciding, so all 8 devices skip the step, halve the scale and keep identical
states. A last step shows the saturation-mode case: two devices write +65504 and -65504
(what saturating hardware writes instead of +-inf) into the same gradient entry; their
mean is finite, yet every device skips.

Run: python examples/data_parallel.py
"""

from __future__ import annotations

import os

# 8 fake CPU devices; must be set before JAX initialises its backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

NUM_DEVICES = 8
jax.config.update("jax_num_cpu_devices", NUM_DEVICES)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import lossscale_jax as lsj  # noqa: E402

AXIS = "batch"
STEPS = 60
LOCAL_BATCH = 16
FEATURES = 4
POISONED = {10: 2, 12: 5, 30: 0, 47: 7}  # step -> the one device fed a poisoned batch
POLICY = lsj.DynamicScale(init_scale=2.0**10, growth_interval=8)
W_TRUE = np.array([[1.0, -2.0], [0.5, 0.0], [-1.5, 1.0], [0.25, 0.75]], np.float32)


def replicate(tree):
    """One copy per device along a new leading axis: ``pmap``'s replicated input."""
    return jax.tree_util.tree_map(
        lambda a: np.broadcast_to(np.asarray(a), (NUM_DEVICES, *np.shape(a))), tree
    )


def loss_fn(params, x, y):
    """Mean squared error, computed in float16 from float32 master weights."""
    p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), params)
    return jnp.mean((x @ p16["w"] + p16["b"] - y) ** 2).astype(jnp.float32)


def make_tx():
    # Check first, average after: the inner chain averages the unscaled float32
    # gradients across devices, and only runs when the (already reduced) decision is
    # "apply".
    average = optax.stateless(lambda g, p: lax.pmean(g, AXIS))
    inner = optax.chain(average, optax.adam(5e-2))
    return lsj.loss_scaling(inner, POLICY, overflow="both", axis_name=AXIS)


def make_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, NUM_DEVICES * LOCAL_BATCH, FEATURES)).astype(np.float32)
    y = x @ W_TRUE + 0.05 * rng.normal(size=(STEPS, NUM_DEVICES * LOCAL_BATCH, 2))
    x, y = x.astype(np.float16), y.astype(np.float16)
    for step, device in POISONED.items():
        x[step, device * LOCAL_BATCH, 0] = np.inf  # one bad row on one device
    return x, y


def train_steps(tx, params, opt_state, xs, ys, local_params):
    """Runs all steps with ``lax.scan``; returns the final state and the metrics."""

    def body(carry, batch):
        params, opt_state = carry
        x, y = batch
        loss = lambda p: lsj.scale_loss(loss_fn(p, x, y), opt_state)  # noqa: E731
        grads = jax.grad(loss)(local_params(params))  # this device's gradients
        updates, opt_state = tx.update(grads, opt_state, params)
        m = lsj.metrics(opt_state)
        return (optax.apply_updates(params, updates), opt_state), (
            m["loss_scale"],
            m["skipped_steps"],
        )

    return lax.scan(body, (params, opt_state), (xs, ys))


def run_pmap(params, x, y):
    tx = make_tx()
    n = NUM_DEVICES

    def per_device(
        a,
    ):  # (steps, n * B, ...) -> (n, steps, B, ...): device d gets its rows
        return np.moveaxis(a.reshape(STEPS, n, LOCAL_BATCH, *a.shape[2:]), 1, 0)

    def step(params, opt_state, xs, ys):
        return train_steps(tx, params, opt_state, xs, ys, lambda p: p)

    (params, _), (scales, skips) = jax.pmap(step, axis_name=AXIS)(
        replicate(params), replicate(tx.init(params)), per_device(x), per_device(y)
    )
    return np.asarray(params["w"]), np.asarray(scales), np.asarray(skips)


def run_shard_map(params, x, y):
    tx = make_tx()
    mesh = jax.make_mesh((NUM_DEVICES,), (AXIS,))

    def step(params, opt_state, xs, ys):
        # Replicated params (P()) would give gradients that shard_map's AD already
        # summed over the mesh; casting them to "varying" keeps each device's own
        # gradients, so the check sees them before any averaging (required in saturating
        # mode).
        local = lambda p: lax.pcast(p, AXIS, to="varying")  # noqa: E731
        (params, opt_state), (scales, skips) = train_steps(
            tx, params, opt_state, xs, ys, local
        )
        return params, scales.T[None], skips.T[None]  # metrics: one row per device

    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), P(), P(None, AXIS), P(None, AXIS)),
            out_specs=(
                P(),
                P(AXIS),
                P(AXIS),
            ),  # P() for params: shard_map checks they agree
        )
    )
    batch = NamedSharding(mesh, P(None, AXIS))
    params, scales, skips = fn(
        params, tx.init(params), jax.device_put(x, batch), jax.device_put(y, batch)
    )
    return np.asarray(params["w"]), np.asarray(scales), np.asarray(skips)


def saturating_step():
    """One step in which devices 0 and 5 write +65504 and -65504 into one entry."""
    tx = make_tx()
    params = {
        "w": jnp.zeros((FEATURES, 2), jnp.float32),
        "b": jnp.zeros(2, jnp.float32),
    }
    grads = np.ones((NUM_DEVICES, FEATURES, 2), np.float16)
    grads[0, 1, 1], grads[5, 1, 1] = 65504.0, -65504.0
    grads = {"w": grads, "b": np.ones((NUM_DEVICES, 2), np.float16)}

    def step(params, opt_state, grads):
        mean_only = lsj.check_overflow(lax.pmean(grads, AXIS), "saturating")
        _, opt_state = tx.update(grads, opt_state, params)
        return mean_only, lsj.metrics(opt_state)["skipped"]

    mean_only, skipped = jax.pmap(step, axis_name=AXIS)(
        replicate(params), replicate(tx.init(params)), grads
    )
    return np.asarray(mean_only), np.asarray(skipped)


def report(name, scales, skips):
    """Prints each device's scale and skip count around each poisoned step, and last."""
    print(f"\n{name}: {NUM_DEVICES} devices, {STEPS} steps")
    print(
        f"{'step':>5}  {'poisoned':>9}  "
        "loss scale on devices 0..7 | skipped steps on 0..7"
    )
    for t in [*sorted({s + d for s in POISONED for d in (-1, 0)}), STEPS - 1]:
        who = f"device {POISONED[t]}" if t in POISONED else "-"
        sc = " ".join(f"{s:g}" for s in scales[:, t])
        sk = " ".join(str(k) for k in skips[:, t])
        print(f"{t:>5}  {who:>9}  {sc} | {sk}")
    agree = bool((scales == scales[:1]).all() and (skips == skips[:1]).all())
    print(f"every device agrees on every step: {agree}")
    return agree


def main():
    params = {
        "w": jnp.zeros((FEATURES, 2), jnp.float32),
        "b": jnp.zeros(2, jnp.float32),
    }
    x, y = make_data()
    results = {}
    for name, run in [("pmap", run_pmap), ("shard_map", run_shard_map)]:
        w, scales, skips = run(params, x, y)
        results[name] = {
            "w": w,
            "scales": scales,
            "skips": skips,
            "agree": report(name, scales, skips),
        }
    w_pmap = results["pmap"]["w"][0]  # pmap returns one copy per device
    same = bool(
        (results["pmap"]["scales"] == results["shard_map"]["scales"]).all()
        and (results["pmap"]["skips"] == results["shard_map"]["skips"]).all()
        and np.allclose(w_pmap, results["shard_map"]["w"], rtol=1e-5, atol=1e-6)
    )
    print(f"\npmap and shard_map: same scales, same skips, same weights: {same}")
    print("learned w (pmap):", np.array2string(w_pmap, precision=2).replace("\n", ""))
    print("true w          :", np.array2string(W_TRUE, precision=2).replace("\n", ""))

    mean_only, skipped = saturating_step()
    print(
        "\nsaturating devices: "
        "device 0 writes +65504, device 5 writes -65504, same entry"
    )
    print(f"  overflow seen by a check of the averaged gradients: {mean_only.tolist()}")
    print(f"  skipped with axis_name='batch', per device:        {skipped.tolist()}")
    results.update(same=same, mean_only=mean_only, saturated_skipped=skipped)
    return results


if __name__ == "__main__":
    main()
