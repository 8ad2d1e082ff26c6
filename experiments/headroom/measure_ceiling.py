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

Output: one JSON line per row (setting, seed) with per-probe arrays, a line per row on stdout,
then the table per setting (``summarize``, ``format_table``); ``--summarize FILE`` prints the
table of a file already measured.

Run: ``python experiments/headroom/measure_ceiling.py --every 2 --validate 10 --out
/tmp/ceiling.json`` (250 steps, 3 seeds, both settings: ``results/ceiling.json``). Small (what
``tests/test_experiments.py`` runs, seconds): ``--steps 6 --seeds 1 --every 2 --settings mean
--validate 1``; ``--summarize results/ceiling.json`` prints README.md's section-1 table.
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


def summarize(rows: list[dict]) -> dict[str, dict]:
    """Per setting, over the probes of every row (seed) of the file: the section-1 table.

    ``c_eq_h``/``c_eq_h_minus_1``/``other``: probes whose ceiling is the room the parameter
    gradients show, one octave below it, or anything else; ``amax_at_ceiling``: (min,
    median) of ``m * 2**c / 65504``; ``first_overflow_gap``: the largest ``log2(65504 / m) -
    (c + 1)``, octaves between the measured room and the first scale that overflows;
    ``dynamic_below``: the mean of ``c - log2 scale`` over the probed steps the job's
    ``DynamicScale`` did not skip; ``validated``/``invalid``: the probes re-checked with the
    unbatched step, and those where it disagreed.
    """
    out: dict[str, dict] = {}
    for setting in dict.fromkeys(r["setting"] for r in rows):
        rs = [r for r in rows if r["setting"] == setting]
        h = np.concatenate([r["h"] for r in rs])
        c = np.concatenate([r["c"] for r in rs])
        m = np.concatenate([r["m"] for r in rs])
        h_real = np.concatenate([r["h_real"] for r in rs])
        below = []
        for r in rs:
            at = np.asarray(r["step"])
            used = np.log2(np.asarray(r["scale"]))[at]
            below.append((np.asarray(r["c"]) - used)[~np.asarray(r["skipped"])[at]])
        checked = [v for r in rs for v in r["valid"] if v is not None]
        amax = m * np.exp2(c) / F16_MAX
        out[setting] = dict(
            rows=len(rs),
            probes=int(c.size),
            c_eq_h=int(np.sum(c == h)),
            c_eq_h_minus_1=int(np.sum(c == h - 1)),
            other=int(np.sum((c < h - 1) | (c > h))),
            amax_at_ceiling=(float(amax.min()), float(np.median(amax))),
            first_overflow_gap=float(np.max(h_real - (c + 1))),
            dynamic_below=float(np.mean(np.concatenate(below))),
            skipped=int(sum(sum(r["skipped"]) for r in rs)),
            validated=len(checked),
            invalid=checked.count(False),
        )
    return out


def format_table(summary: dict[str, dict]) -> str:
    """The section-1 table of ``README.md`` (markdown)."""
    lines = [
        "| setting | probes | `c == h` | `c == h - 1` | `c < h - 1` or `c > h` "
        "| scaled parameter amax at the ceiling, / 65504 (min, median) |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        n = s["probes"]
        lines.append(
            f"| {name} | {n} | {s['c_eq_h']} ({s['c_eq_h'] / n:.1%}) | "
            f"{s['c_eq_h_minus_1']} ({s['c_eq_h_minus_1'] / n:.1%}) | {s['other']} | "
            f"{s['amax_at_ceiling'][0]:.2f}, {s['amax_at_ceiling'][1]:.2f} |"
        )
    return "\n".join(lines)


def read_rows(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv=None) -> dict[str, dict]:
    """Measures (``--out``) or reads (``--summarize``) the rows; prints and returns the table."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=gpt.STEPS)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--every", type=int, default=1)
    p.add_argument(
        "--validate", type=int, default=0, help="check c with the unbatched step every N probes"
    )
    p.add_argument("--settings", default="mean,update_2^19")
    out_or_file = p.add_mutually_exclusive_group(required=True)
    out_or_file.add_argument("--out", type=pathlib.Path, help="JSON lines to write")
    out_or_file.add_argument(
        "--summarize", type=pathlib.Path, help="only print the table of this measured file"
    )
    a = p.parse_args(argv)
    if a.summarize is not None:
        summary = summarize(read_rows(a.summarize))
        print(format_table(summary))
        return summary

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
    out.close()
    summary = summarize(read_rows(a.out))
    print(format_table(summary))
    return summary


if __name__ == "__main__":
    main()
