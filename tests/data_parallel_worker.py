"""One process of the multi-process data-parallel test (run by test_data_parallel.py).

Usage: python data_parallel_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON

Each process has 2 CPU devices; the processes join with ``jax.distributed.initialize`` and
CPU collectives (gloo). A few training steps run under ``pmap`` over all 4 devices; on
step 1 only process 1 sees an overflow (inf on its first device), on step 3 process 0 and
process 1 write +65504 and -65504 into the same gradient element (saturating devices).
Each process writes what every one of its devices holds, floats as hex strings.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

LOCAL_DEVICES = 2
jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

import lossscale_jax as lsj  # noqa: E402

AXIS = "batch"
STEPS = 5
POLICY = dict(init_scale=2.0**8, growth_interval=2)


def hexed(a) -> list | str | int | bool:
    a = np.asarray(a)
    if a.dtype.kind == "f":
        return [float(v).hex() for v in a.ravel().tolist()] if a.ndim else float(a).hex()
    return a.tolist()


def main(process_id: int, num_processes: int, port: int, out: str) -> None:
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=60,
    )
    assert jax.local_device_count() == LOCAL_DEVICES
    assert jax.device_count() == LOCAL_DEVICES * num_processes

    # poison[step, global device]: the value a device writes into grads["w"][0, 0].
    n = jax.device_count()
    poison = np.zeros((STEPS, n), np.float16)
    poisoned = np.zeros((STEPS, n), bool)
    poison[1, LOCAL_DEVICES * 1 + 0], poisoned[1, LOCAL_DEVICES * 1 + 0] = np.inf, True
    poison[3, 1], poisoned[3, 1] = 65504.0, True  # process 0, second device
    poison[3, LOCAL_DEVICES + 1], poisoned[3, LOCAL_DEVICES + 1] = -65504.0, True  # process 1
    mine = slice(process_id * LOCAL_DEVICES, (process_id + 1) * LOCAL_DEVICES)

    inner = optax.chain(optax.stateless(lambda g, p: lax.pmean(g, AXIS)), optax.adam(1e-2))
    tx = lsj.loss_scaling(inner, lsj.DynamicScale(**POLICY), overflow="both", axis_name=AXIS)
    params = {"w": jnp.ones((2, 2), jnp.float32), "b": jnp.zeros(2, jnp.float32)}

    def loss_fn(p, x):
        p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), p)
        return jnp.mean((x @ p16["w"] + p16["b"]) ** 2).astype(jnp.float32)

    def train(params, opt_state, xs, pv, pz):
        def body(carry, inp):
            params, opt_state = carry
            x, v, z = inp
            grads = jax.grad(lambda p: lsj.scale_loss(loss_fn(p, x), opt_state))(params)
            w = grads["w"].astype(jnp.float16)
            grads = {
                "w": w.at[0, 0].set(jnp.where(z, v, w[0, 0])),
                "b": grads["b"].astype(jnp.float16),
            }
            updates, opt_state = tx.update(grads, opt_state, params)
            ls = lsj.get_loss_scale_state(opt_state)
            return (optax.apply_updates(params, updates), opt_state), (ls.scale, ls.last_skipped)

        return lax.scan(body, (params, opt_state), (xs, pv, pz))

    rng = np.random.default_rng(process_id)  # each process its own data
    xs = rng.normal(size=(LOCAL_DEVICES, STEPS, 4, 2)).astype(np.float16)
    rep = lambda t: jax.tree_util.tree_map(  # noqa: E731
        lambda a: jnp.broadcast_to(a, (LOCAL_DEVICES, *a.shape)), t
    )
    (params, state), (scales, skipped) = jax.pmap(train, axis_name=AXIS)(
        rep(params), rep(tx.init(params)), xs, poison[:, mine].T, poisoned[:, mine].T
    )

    ls = lsj.get_loss_scale_state(state)
    devices = []
    for i in range(LOCAL_DEVICES):
        devices.append(
            {
                "process": process_id,
                "device": process_id * LOCAL_DEVICES + i,
                "state": {
                    "params": {k: hexed(v[i]) for k, v in params.items()},
                    "adam_count": int(state.inner_state[-1][0].count[i]),
                    "mu": {k: hexed(v[i]) for k, v in state.inner_state[-1][0].mu.items()},
                    "loss_scale": {
                        jax.tree_util.keystr(path): hexed(leaf[i])
                        for path, leaf in jax.tree_util.tree_flatten_with_path(ls)[0]
                    },
                    "trajectory": {"scale": hexed(scales[i]), "last_skipped": hexed(skipped[i])},
                },
            }
        )
    with open(out, "w") as f:
        json.dump(
            {
                "devices": devices,
                "policy": POLICY,
                "overflow_steps_expected": poisoned.any(axis=1).tolist(),
            },
            f,
        )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
