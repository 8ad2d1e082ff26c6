"""How far below the parameter gradients' headroom the GPT job's real overflow ceiling lies.

Replays the main job's ``fp16_dynamic`` rows (``examples/train_gpt.py``: same seeds, weights,
batches and policy, so the same trajectories as its table) and, every ``--every`` steps,
measures on that step's weights and batch:

- ``m``: the largest parameter gradient at scale 1, ``max |g| / S`` over every leaf of the
  float16 gradient taken at a power-of-two scale ``S`` at which it is finite (exact: scaling
  by a power of two commutes with float16 rounding away from its range limits);
- ``h = floor(log2(65504 / m))``: the largest power-of-two scale at which no *parameter*
  gradient would exceed float16's largest value (the headroom the statistic sees);
- ``c``: the largest power-of-two scale at which the float16 backward pass gives finite
  parameter gradients (the real ceiling; an intermediate activation gradient that overflows
  reaches the parameter gradients as inf or nan).

The backward pass is linear in its seed, so the cotangents at scale ``2**k`` are ``2**k`` times
those at scale 1: ``c`` is found by taking the gradient at eight consecutive powers of two in
one batched call (``jax.vmap`` over the scale; the forward pass is shared). ``--validate``
re-checks ``c`` and ``c + 1`` with the job's own (unbatched) jitted gradient function.

Output: one JSON line per row (setting, seed) with per-probe arrays; a summary on stdout.

Run: ``python experiments/headroom/measure_ceiling.py --out /tmp/ceiling.json``
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))

import train_gpt as gpt  # noqa: E402

import lossscale_jax as lsj  # noqa: E402

F16_MAX = float(jnp.finfo(jnp.float16).max)
K = 8  # scales per batched probe


def leaf_amax(grads) -> jax.Array:
    """Largest |g| over every leaf, float32 (nan if any leaf holds nan)."""
    return jnp.max(
        jnp.stack([jnp.max(jnp.abs(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)])
    )


def make_probe(loss_fn):
    base = lsj.NoScale().init()

    @jax.jit
    def probe(params, tokens, offsets, weight, exps):
        def at(e):
            scale = jnp.ldexp(jnp.float32(1.0), e)
            grads, _ = gpt.gradients(
                loss_fn, gpt.F16, params, tokens, offsets, weight, base.replace(scale=scale)
            )
            return lsj.check_overflow(grads), leaf_amax(grads) / scale

        return jax.vmap(at)(exps)

    return probe


def ceiling(probe, args, top: int) -> tuple[int, float]:
    """``(c, m)``: the largest finite power-of-two exponent and the scale-1 amax there."""
    for _ in range(40):
        exps = jnp.asarray(top - np.arange(K), jnp.int32)
        over, amax = jax.device_get(probe(*args, exps))
        finite = np.flatnonzero(~over)
        if len(finite) == 0:  # every scale overflowed: look lower
            top -= K
            continue
        if finite[0] == 0:  # the top one was finite: look higher
            top += K - 1
            continue
        i = finite[0]
        return int(top - i), float(amax[i])
    raise RuntimeError("no ceiling found")


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=gpt.STEPS)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--every", type=int, default=1)
    p.add_argument(
        "--validate", type=int, default=0, help="check c with the unbatched step every N probes"
    )
    p.add_argument("--settings", default="mean,update_2^19")
    p.add_argument("--out", type=pathlib.Path, required=True)
    a = p.parse_args(argv)

    corpus = gpt.load_corpus()
    vocab = corpus.vocab_size
    tokens = jnp.asarray(corpus.train)
    loss_fn = gpt.loss_function(vocab)
    probe = make_probe(loss_fn)
    config = next(c for c in gpt.CONFIGS if c.name == "fp16_dynamic")
    tx = gpt.make_tx(config, a.steps)
    base = lsj.NoScale().init()
    settings = [s for s in gpt.SETTINGS if s.name in a.settings.split(",")]
    out = a.out.open("w")
    t0 = time.time()
    for setting in settings:
        weight = jnp.float32(setting.loss_weight)
        for seed in range(a.seeds):
            params = gpt.init_params(vocab, jnp.int32(seed))
            offsets = gpt.batch_offsets(seed, a.steps, len(corpus.train))
            state = lsj.TrainState.create(apply_fn=loss_fn, params=params, tx=tx)
            rec = {k: [] for k in ("step", "scale", "skipped", "m", "h", "c", "h_real", "valid")}
            top = None
            for t in range(a.steps):
                ls = lsj.get_loss_scale_state(state.opt_state)
                args = (state.params, tokens, offsets[t], weight)
                grads, _ = gpt.gradients(loss_fn, gpt.F16, *args, ls)
                if t % a.every == 0:
                    if top is None:
                        top = 20 + round(-math.log2(setting.loss_weight))
                    c, m = ceiling(probe, args, top)
                    h_real = math.log2(F16_MAX / m)  # octaves of headroom at scale 1
                    h = math.floor(h_real)
                    top = max(h + 1, c + 1)
                    valid = None
                    if a.validate and (len(rec["step"]) % a.validate == 0):
                        ok = []
                        for e in (c, c + 1):
                            g, _ = gpt.gradients(
                                loss_fn, gpt.F16, *args, base.replace(scale=jnp.float32(2.0**e))
                            )
                            ok.append(not bool(lsj.check_overflow(g)))
                        valid = ok == [True, False]
                    rec["step"].append(t)
                    rec["m"].append(m)
                    rec["h"].append(h)
                    rec["h_real"].append(h_real)
                    rec["c"].append(c)
                    rec["valid"].append(valid)
                state, scale, skipped = gpt.apply_gradients(state, grads)
                rec["scale"].append(float(scale))
                rec["skipped"].append(bool(skipped))
            row = dict(setting=setting.name, seed=seed, **rec)
            out.write(json.dumps(row) + "\n")
            out.flush()
            gap = np.asarray(rec["h"]) - np.asarray(rec["c"])
            print(
                f"{setting.name} seed {seed}: {len(gap)} probes, c<h on {np.mean(gap > 0):.0%}, "
                f"h-c min/median/max {gap.min()}/{np.median(gap)}/{gap.max()}, "
                f"c range 2^{min(rec['c'])}-2^{max(rec['c'])}, skipped {sum(rec['skipped'])}, "
                f"valid {[v for v in rec['valid'] if v is not None].count(False)} bad, "
                f"{time.time() - t0:.0f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
