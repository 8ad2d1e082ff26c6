"""HeadroomScale on a model whose loss is float16: with and without taps, against DynamicScale.

The model is the fault-injection soak's MLP (``tests/soak/fault_soak.py``: tanh, MSE,
computed in float16 from float32 master weights, Adam 1e-3). Its loss is float16, so the
cotangent of the loss *is* the scale: 2**16 overflows it whatever the parameter gradients say,
and they say the room is 2**20 or more. Every step also measures the real ceiling ``c``: the
largest power of two ``2**e`` (``e`` in 0..40) at which this step's float16 backward pass gives
finite gradients (all 41 scales in one ``vmap``, on the step's own weights and batch, before the
update).

Rows (1,500 steps each, one ``lax.scan`` per row):

- ``dynamic``: ``DynamicScale(growth_interval=500)``, the baseline of the comparison;
- ``headroom``: ``HeadroomScale()`` fed the parameter gradients only (``jax.grad``);
- ``headroom_taps``: ``HeadroomScale()`` fed the taps too (``lsj.taps.value_and_grad``:
  ``lsj.scale_loss`` taps the loss).

Per row: skipped steps, the share of steps whose scale is within 3 octaves below the ceiling
(``c - 3 <= log2 scale <= c``), the share 4 or more octaves below it, and the final scale.

Two settings (``SETTINGS``), 3 seeds each. Run: ``python experiments/headroom/float16_loss.py``
(about 2 minutes on 2 CPU cores); the table is ``results/float16_loss.md``. Small (what
``tests/test_experiments.py`` runs, seconds): ``--seeds 1 --settings small --exponents 10-20``
(the ceiling is 2**15, so probing 2**10..2**20 finds the same one).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lossscale_jax as lsj

SHAPES = {"b1": (16,), "b2": (4,), "w1": (8, 16), "w2": (16, 4)}
EXPONENTS = jnp.arange(41, dtype=jnp.float32)


# Settings: (weights' init std, targets' amplitude). "small" has gradients 2**10 smaller, so
# the parameter gradients show a room far above the loss's ceiling (the case HeadroomScale
# without taps mishandled).
SETTINGS = {"default": (0.3, 1.0), "small": (0.003, 0.001)}


def init_params(seed: int = 1, std: float = 0.3) -> dict[str, jax.Array]:
    key = jax.random.PRNGKey(seed)
    return {
        n: std * jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32)
        for i, (n, s) in enumerate(SHAPES.items())
    }


def loss16(p16: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    """The model's loss, computed (and returned) in float16."""
    h = jnp.tanh(x @ p16["w1"] + p16["b1"])
    return jnp.mean((h @ p16["w2"] + p16["b2"] - y) ** 2)


def half(params: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), params)


def batch(key: jax.Array, t: jax.Array, amplitude: float) -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.fold_in(key, t), (32, 8), jnp.float16)
    return x, jnp.sin(x[:, :4]) * jnp.float16(amplitude)


def ceiling(params: Any, x: jax.Array, y: jax.Array, exponents: jax.Array) -> jax.Array:
    """log2 of the largest power-of-two scale whose float16 backward stays finite (-1: none)."""

    def finite_at(e: jax.Array) -> jax.Array:
        s = jnp.ldexp(jnp.float32(1.0), e.astype(jnp.int32))
        g = jax.grad(lambda p: loss16(p, x, y).astype(jnp.float32) * s)(half(params))
        return jnp.logical_not(lsj.check_overflow(g))

    ok = jax.vmap(finite_at)(exponents)
    return jnp.max(jnp.where(ok, exponents, -1.0))


def run(
    policy: lsj.LossScalePolicy,
    use_taps: bool,
    steps: int = 1500,
    seed: int = 1,
    setting: str = "default",
    exponents: jax.Array = EXPONENTS,
) -> dict:
    """One row: per step the scale used, whether it was skipped, and the ceiling."""
    std, amplitude = SETTINGS[setting]
    tx = lsj.loss_scaling(optax.adam(1e-3), policy)
    params = init_params(seed, std)
    key = jax.random.PRNGKey(seed)

    def step(carry: Any, t: jax.Array) -> Any:
        params, opt_state = carry
        x, y = batch(key, t, amplitude)
        scale = lsj.get_loss_scale_state(opt_state).scale

        def scaled(p: Any) -> jax.Array:
            return lsj.scale_loss(loss16(half(p), x, y), opt_state)

        if use_taps:
            _, grads, taps = lsj.taps.value_and_grad(scaled)(params)
            updates, opt_state = tx.update(grads, opt_state, params, taps=taps)
        else:
            grads = jax.grad(scaled)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
        skipped = lsj.get_loss_scale_state(opt_state).last_skipped
        out = (scale, skipped, ceiling(params, x, y, exponents))
        return (optax.apply_updates(params, updates), opt_state), out

    init = (params, tx.init(params))
    (_, opt_state), (scales, skipped, ceil) = jax.jit(
        lambda c: jax.lax.scan(step, c, jnp.arange(steps))
    )(init)
    return summarize(np.asarray(scales), np.asarray(skipped), np.asarray(ceil))


def summarize(scales: np.ndarray, skipped: np.ndarray, ceil: np.ndarray) -> dict:
    log2s = np.log2(scales)
    below = ceil - log2s  # octaves below the ceiling (< 0: above it, an overflow)
    return {
        "steps": int(scales.size),
        "skipped": int(skipped.sum()),
        "within_3_octaves": float(np.mean((below >= 0) & (below <= 3))),
        "4_or_more_below": float(np.mean(below >= 4)),
        "ceiling_min_max": [float(ceil.min()), float(ceil.max())],
        "final_scale_log2": float(log2s[-1]),
    }


ROWS = {
    "dynamic": (lambda: lsj.DynamicScale(growth_interval=500), False),
    "headroom": (lambda: lsj.HeadroomScale(), False),
    "headroom_taps": (lambda: lsj.HeadroomScale(), True),
}


def table(results: dict[str, dict]) -> list[str]:
    """The rows' markdown table (``results/float16_loss.md``), one string per line."""
    lines = [
        "| setting / row / seed | skipped | within 3 octaves of the ceiling "
        "| 4+ octaves below | final scale |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['skipped']} | {r['within_3_octaves']:.1%} | "
            f"{r['4_or_more_below']:.1%} | 2^{r['final_scale_log2']:.0f} |"
        )
    return lines


def main(
    steps: int = 1500,
    seeds: Sequence[int] = (0, 1, 2),
    settings: Sequence[str] = tuple(SETTINGS),
    exponents: jax.Array = EXPONENTS,
) -> dict[str, dict]:
    """Every (setting, seed, row); prints the table and returns the rows by name."""
    results = {
        f"{setting}/{name}/seed{seed}": run(make(), taps, steps, seed, setting, exponents)
        for setting in settings
        for seed in seeds
        for name, (make, taps) in ROWS.items()
    }
    print("\n".join(table(results)))
    return results


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--seeds", default="0,1,2", help="comma-separated")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated")
    p.add_argument(
        "--exponents", default="0-40", help="the probed scales' exponents, LO-HI (inclusive)"
    )
    a = p.parse_args(argv)
    unknown = set(a.settings.split(",")) - set(SETTINGS)
    if unknown:
        p.error(f"--settings: unknown {sorted(unknown)}; known: {', '.join(SETTINGS)}")
    return a


if __name__ == "__main__":
    a = parse_args()
    lo, hi = (int(e) for e in a.exponents.split("-"))
    out = main(
        a.steps,
        [int(seed) for seed in a.seeds.split(",")],
        a.settings.split(","),
        jnp.arange(lo, hi + 1, dtype=jnp.float32),
    )
    print(json.dumps(out, indent=1))
