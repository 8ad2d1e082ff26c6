"""Where the parameter gradients say nothing about the ceiling: measured, then the rule replayed.

1. ``measure``: the fault-injection soak's MLP (``tests/soak/fault_soak.py``: tanh, MSE, its
   loss computed in float16) trained in float32; every 250 steps, ``h`` (the room its float16
   parameter gradients show) against ``c`` (the largest power-of-two scale whose float16
   backward stays finite), both as in ``measure_ceiling.py``. Its loss is float16, so the
   cotangent of the loss *is* the scale: 2**16 overflows whatever the gradients.
2. ``replay``: the rule (``model.py``) for 10,000 steps against a fixed ceiling 2**15 with the
   room ``gap`` octaves above it (noise 0.5 octave), entering ``1 / scale`` into the peak on an
   overflow never, always, or once the margin is spent (``bump``; the rule).

Run: ``python experiments/headroom/blind_spot.py``
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import model
import numpy as np
import optax

import lossscale_jax as lsj

SHAPES = {"b1": (16,), "b2": (4,), "w1": (8, 16), "w2": (16, 4)}


def loss_fn(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2).astype(jnp.float32)


@jax.jit
def probe(params, x, y, e):
    p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), params)
    s = jnp.ldexp(jnp.float32(1), e)
    g = jax.grad(lambda p: loss_fn(p, x, y) * s)(p16)
    amax = jnp.max(jnp.stack([jnp.max(jnp.abs(v.astype(jnp.float32))) for v in g.values()]))
    return lsj.check_overflow(g), amax / s


def measure(steps: int = 3001) -> None:
    key = jax.random.PRNGKey(1)
    params = {
        n: 0.3 * jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32)
        for i, (n, s) in enumerate(SHAPES.items())
    }
    adam = optax.adam(1e-3)
    state = adam.init(params)
    grad = jax.jit(jax.grad(loss_fn))
    for t in range(steps):
        x = jax.random.normal(jax.random.fold_in(key, t), (32, 8), jnp.float16)
        y = jnp.sin(x[:, :4])
        if t % 250 == 0:
            res = [(e, *(v.item() for v in probe(params, x, y, e))) for e in range(40)]
            c = max(e for e, over, _ in res if not over)
            m = next(a for e, _, a in res if e == c)
            h = math.floor(math.log2(65504 / m))
            print(f"step {t}: room h = 2^{h}, ceiling c = 2^{c}, h - c = {h - c}")
        g = grad(params, x.astype(jnp.float32), y.astype(jnp.float32))
        u, state = adam.update(g, state, params)
        params = optax.apply_updates(params, u)


def replay(steps: int = 10_000) -> None:
    rng = np.random.default_rng(0)
    for bump in ("never", "always", "spent"):
        for gap in (2, 5, 8, 10):
            h = model.Headroom(bump=bump, max_scale=math.inf)
            s, over = h.init(), 0
            for _ in range(steps):
                room = 15 + gap + rng.normal(0, 0.5)
                o = math.log2(float(s["scale"])) > 15
                over += o
                s = model.step(h, s, o, 2.0**-room)
            print(f"bump={bump} gap={gap}: skipped {over} of {steps}, margin {s['margin']}")


if __name__ == "__main__":
    measure()
    replay()
