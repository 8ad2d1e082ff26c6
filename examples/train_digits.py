"""Mixed-precision validation on a real data set: does float16 match float32?

A small Flax CNN learns scikit-learn's bundled digits (1797 8x8 images, no
download) four ways, each with the same seeds:

- ``fp32``: float32 compute, the reference;
- ``fp16, no scaling``: float16 compute (``dtype=float16``) on float32 master
  weights (``param_dtype=float32``), no loss scale;
- ``fp16, static``: the same with ``StaticScale``;
- ``fp16, dynamic``: the same with ``DynamicScale``.

Every configuration uses ``lsj.TrainState`` (the step does not advance on a
skipped step; BatchNorm statistics are rolled back) and ``lsj.loss_scaling``
around Adam; fp32 runs under ``NoScale()``. Every ``--probe-every`` steps the
float16 gradient is compared with the float32 gradient of the same weights on
the same batch: an entry that is 0 in float16 but not in float32 is underflow
that the float16 backward pass actually lost.

Output: a table (validation accuracy mean ± std over seeds, underflow lost,
skipped-step rate against the 0.5% guideline, final scale) on stdout and in
``OUT/digits_table.md`` (+ ``.json``), and ``OUT/digits_plot.png`` (loss and
loss scale against step).

A second, smaller table, "where float16 underflows", probes the same trained
float32 weights with settings that shrink the gradients (a summed vs a mean
loss, a deeper net, the loss scaled down), to show where unscaled float16
starts to lose gradient entries on this task.

``--loss-weight W`` trains every configuration on ``W * loss`` (e.g. 2**-8): the
gradients shrink as they would for a mean over a much larger batch, and unscaled
float16 starts to lose them (see docs/validating.md for the measured tables).

Run: ``python examples/train_digits.py [--steps N] [--seeds K] [--out DIR] [--quick]``
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import lossscale_jax as lsj

F16, F32 = jnp.float16, jnp.float32

BATCH = 64
LR = 2e-3
STATIC_SCALE = 2.0**10
DYNAMIC = dict(
    init_scale=2.0**15, growth_interval=100
)  # short run: grow every 100 good steps
GUIDELINE = 0.005  # keep skipped steps under 0.5%


# --------------------------------------------------------------------------
# Data and model.


def load_data(seed: int = 0):
    """Digits as (N, 8, 8, 1) float32 in [0, 1]; a stratified 75/25 split."""
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    x_tr, x_va, y_tr, y_va = train_test_split(
        x, y, test_size=0.25, random_state=seed, stratify=y
    )
    return jnp.asarray(x_tr), jnp.asarray(y_tr), jnp.asarray(x_va), jnp.asarray(y_va)


class CNN(nn.Module):
    """Conv-BN-ReLU blocks, pooling, a dense head; ``dtype`` compute, float32 weights.

    Flax's own mixed precision: ``dtype`` is the compute dtype, ``param_dtype=float32``
    keeps the master weights, so the gradients come back in float32, computed in
    ``dtype``.
    """

    dtype: Any = F32
    depth: int = 2  # conv blocks
    width: int = 32

    @nn.compact
    def __call__(self, x, train: bool = True):
        kw = dict(dtype=self.dtype, param_dtype=F32)
        x = x.astype(self.dtype)
        for i in range(self.depth):
            # No bias before BatchNorm: its gradient is 0 in exact arithmetic, and its
            # rounding noise would count as "underflow" in the probe.
            x = nn.Conv(
                self.width if i else self.width // 2, (3, 3), use_bias=False, **kw
            )(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9, **kw)(x)
            x = nn.relu(x)
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(64, **kw)(x))
        return nn.Dense(10, **kw)(x)


# One apply function per compute dtype, shared by every configuration and seed: jitted
# functions that take it as a static argument compile once per dtype.
APPLY = {F32: CNN(dtype=F32).apply, F16: CNN(dtype=F16).apply}


def cross_entropy(logits, labels, reduction="mean"):
    """Softmax cross-entropy in float32 (the logits may be float16)."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(F32), labels)
    return jnp.sum(losses) if reduction == "sum" else jnp.mean(losses)


# --------------------------------------------------------------------------
# Configurations.

CONFIGS: dict[str, tuple[Any, lsj.LossScalePolicy]] = {
    "fp32": (F32, lsj.NoScale()),
    "fp16, no scaling": (F16, lsj.NoScale()),
    f"fp16, static {STATIC_SCALE:g}": (F16, lsj.StaticScale(STATIC_SCALE)),
    "fp16, dynamic": (F16, lsj.DynamicScale(**DYNAMIC)),
}


def make_tx(policy):
    return lsj.loss_scaling(optax.adam(LR), policy)


def make_state(apply_fn, tx, seed, x_example):
    """Same float32 initial weights for every configuration of a seed."""
    variables = CNN(dtype=F32).init(jax.random.key(seed), x_example[:2])
    return lsj.TrainState.create(
        apply_fn=apply_fn,
        params=variables["params"],
        tx=tx,
        batch_stats=variables["batch_stats"],
    )


def grads_of(apply_fn, params, batch_stats, x, y, opt_state, weight):
    """Gradients of the scaled loss, the new BatchNorm statistics, the (unscaled) loss.

    The differentiated loss is ``weight * mean cross-entropy`` (``--loss-weight``).
    """

    def loss_fn(p):
        logits, upd = apply_fn(
            {"params": p, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
        )
        loss = cross_entropy(logits, y)
        return lsj.scale_loss(loss * weight, opt_state), (upd["batch_stats"], loss)

    grads, (stats, loss) = jax.grad(loss_fn, has_aux=True)(params)
    return grads, stats, loss


def lost_entries(g16, g32):
    """(#entries 0 in float16 but not in float32, #entries non-zero in float32)."""
    pairs = zip(
        jax.tree_util.tree_leaves(g16), jax.tree_util.tree_leaves(g32), strict=True
    )
    lost = sum(jnp.sum((a == 0) & (b != 0)) for a, b in pairs)
    nonzero = sum(jnp.sum(b != 0) for b in jax.tree_util.tree_leaves(g32))
    return jnp.asarray(lost, jnp.int32), jnp.asarray(nonzero, jnp.int32)


@jax.jit
def train_step(state, x, y, weight):
    """One step; the state's tx and apply_fn are static: one compilation per config."""
    grads, stats, loss = grads_of(
        state.apply_fn, state.params, state.batch_stats, x, y, state.opt_state, weight
    )
    scale = lsj.get_loss_scale_state(state.opt_state).scale  # the scale this step used
    state = state.apply_gradients(grads=grads, batch_stats=stats)
    return state, dict(
        loss=loss, scale=scale, skipped=lsj.metrics(state.opt_state)["skipped"]
    )


@functools.partial(jax.jit, static_argnums=(0, 1))
def probe_underflow(apply16, apply32, params, batch_stats, x, y, loss_scale, weight):
    """Counts the gradient entries a float16 backward pass loses to underflow.

    Both gradients are taken at the same float32 weights on the same batch: the
    float16 one of the loss scaled by ``loss_scale`` and the float32 one.
    """
    g16, _, _ = grads_of(apply16, params, batch_stats, x, y, loss_scale, weight)
    g32, _, _ = grads_of(
        apply32, params, batch_stats, x, y, lsj.NoScale().init(), weight
    )
    return lost_entries(g16, g32)


@functools.partial(jax.jit, static_argnums=0)
def accuracy(apply_fn, params, batch_stats, x, y):
    logits = apply_fn({"params": params, "batch_stats": batch_stats}, x, train=False)
    return jnp.mean((jnp.argmax(logits, -1) == y).astype(F32))


def batch_indices(seed: int, steps: int, n: int) -> np.ndarray:
    """(steps, BATCH) indices: reshuffled epochs, the same for every configuration."""
    rng = np.random.default_rng(seed)
    per_epoch = n // BATCH
    epochs = -(-steps // per_epoch)
    idx = np.concatenate(
        [rng.permutation(n)[: per_epoch * BATCH] for _ in range(epochs)]
    )
    return idx.reshape(-1, BATCH)[:steps].astype(np.int32)


# --------------------------------------------------------------------------
# Where does float16 underflow on this task?


@functools.partial(jax.jit, static_argnums=0)
def _lost_at(depth, params, batch_stats, x, y, factor):
    """Entries float16 loses (non-zero in float32) for the mean loss x ``factor``."""

    def grads(dtype):
        def loss_fn(p):
            logits, _ = CNN(dtype=dtype, depth=depth).apply(
                {"params": p, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
            )
            return cross_entropy(logits, y) * factor

        return jax.grad(loss_fn)(params)

    return lost_entries(grads(F16), grads(F32))


def where_it_underflows(params, batch_stats, x, y, seed=0, deep=6):
    """Fraction of gradient entries unscaled float16 loses, in settings that shrink it.

    The trained float32 weights are fixed, only the loss changes: a summed loss is the
    mean times the batch size; a loss scale below 1 (a too-small initial scale) shrinks
    every gradient. A deeper, freshly initialised net is measured the same way.
    """
    n = x.shape[0]
    settings = {
        "mean loss (the default setting)": 1.0,
        f"summed loss (mean x {n})": float(n),
        "mean loss x 2^-4 (a loss scale of 1/16)": 2.0**-4,
        "mean loss x 2^-8 (a loss scale of 1/256)": 2.0**-8,
    }
    rows = {}
    for name, factor in settings.items():
        lost, nonzero = _lost_at(2, params, batch_stats, x, y, jnp.float32(factor))
        rows[name] = int(lost) / max(int(nonzero), 1)
    variables = CNN(dtype=F32, depth=deep).init(jax.random.key(seed), x[:2])
    lost, nonzero = _lost_at(
        deep, variables["params"], variables["batch_stats"], x, y, jnp.float32(1.0)
    )
    rows[f"deeper net ({deep} conv blocks, at init), mean loss"] = int(lost) / max(
        int(nonzero), 1
    )
    return rows


# --------------------------------------------------------------------------
# The job.


def run(
    steps: int,
    seeds: int,
    probe_every: int,
    loss_weight: float = 1.0,
    progress: bool = True,
):
    """Trains every configuration for every seed; returns histories and accuracies."""
    from tqdm.auto import tqdm

    x_tr, y_tr, x_va, y_va = load_data()
    weight = jnp.float32(loss_weight)
    results: dict[str, list[dict[str, Any]]] = {}
    bar = tqdm(
        total=len(CONFIGS) * seeds * steps,
        unit="step",
        disable=not progress,
        dynamic_ncols=True,
        mininterval=0.5,
    )
    trained_fp32 = None
    for name, (dtype, policy) in CONFIGS.items():
        apply_fn, tx = (
            APPLY[dtype],
            make_tx(policy),
        )  # one compilation per configuration
        results[name] = []
        for seed in range(seeds):
            bar.set_description(f"{name}, seed {seed}")
            state = make_state(apply_fn, tx, seed, x_tr)
            idx = jnp.asarray(batch_indices(seed, steps, x_tr.shape[0]))
            hist, lost, nonzero = [], [], []
            for t in range(steps):
                x, y = x_tr[idx[t]], y_tr[idx[t]]
                if name != "fp32" and t % probe_every == 0:
                    counts = probe_underflow(
                        apply_fn,
                        APPLY[F32],
                        state.params,
                        state.batch_stats,
                        x,
                        y,
                        state.opt_state,
                        weight,
                    )
                    lost.append(counts[0])
                    nonzero.append(counts[1])
                state, h = train_step(state, x, y, weight)
                hist.append(h)
                bar.update(1)
            hist = jax.device_get(hist)
            results[name].append(
                dict(
                    history={k: np.array([h[k] for h in hist]) for k in hist[0]},
                    lost=int(np.sum(jax.device_get(lost))),
                    nonzero=int(np.sum(jax.device_get(nonzero))),
                    accuracy=float(
                        accuracy(apply_fn, state.params, state.batch_stats, x_va, y_va)
                    ),
                    metrics={
                        k: float(v) for k, v in lsj.metrics(state.opt_state).items()
                    },
                    step=int(state.step),
                )
            )
            if name == "fp32" and seed == 0:
                trained_fp32 = state
    bar.close()
    return results, trained_fp32, (x_tr, y_tr)


def summarize(results) -> dict[str, dict[str, float]]:
    rows = {}
    for name, runs in results.items():
        acc = np.array([r["accuracy"] for r in runs])
        lost = sum(r["lost"] for r in runs)
        nonzero = sum(r["nonzero"] for r in runs)
        total = sum(r["metrics"]["total_steps"] for r in runs)
        skipped = sum(r["metrics"]["skipped_steps"] for r in runs)
        rows[name] = dict(
            acc_mean=float(acc.mean()),
            acc_std=float(acc.std(ddof=1)) if len(acc) > 1 else 0.0,
            underflow_lost=lost / max(nonzero, 1),
            skipped_rate=skipped / max(total, 1),
            final_scale=float(np.mean([r["metrics"]["loss_scale"] for r in runs])),
            final_loss=float(
                np.mean([r["history"]["loss"][-20:].mean() for r in runs])
            ),
            nan_loss=bool(
                any(not np.isfinite(r["history"]["loss"]).all() for r in runs)
            ),
        )
    return rows


def format_table(rows, steps, seeds, loss_weight=1.0) -> str:
    plural = "s" if seeds != 1 else ""
    head = (
        f"| configuration | val. accuracy (mean ± std, {seeds} seed{plural}) "
        "| gradient entries lost to underflow | skipped steps (guideline < 0.5%) "
        "| final scale |"
    )
    lines = [head, "|---|---|---|---|---|"]
    for name, r in rows.items():
        lost = "reference" if name == "fp32" else f"{100 * r['underflow_lost']:.3f}%"
        flag = "ok" if r["skipped_rate"] <= GUIDELINE else "over"
        lines.append(
            f"| {name} | {100 * r['acc_mean']:.2f}% ± {100 * r['acc_std']:.2f} "
            f"| {lost} | {100 * r['skipped_rate']:.2f}% ({flag}) "
            f"| {r['final_scale']:.10g} |"
        )
    weight = "" if loss_weight == 1.0 else f" x {loss_weight:g}"
    lines.append(
        f"\n{steps} steps of Adam({LR:g}), batch {BATCH}, mean cross-entropy{weight}; "
        "`DynamicScale(init_scale=2**15, "
        f"growth_interval={DYNAMIC['growth_interval']})`."
    )
    return "\n".join(lines)


def plot(results, path: pathlib.Path, title: str) -> None:
    """One column per configuration: training loss (top) and loss scale (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(
        2,
        len(names),
        figsize=(3.6 * len(names), 6.2),
        sharex=True,
        sharey="row",
        squeeze=False,
    )
    ref = np.mean([r["history"]["loss"] for r in results[names[0]]], axis=0)
    for col, name in enumerate(names):
        ax_loss, ax_scale = axes[0, col], axes[1, col]
        if col:
            ax_loss.plot(_smooth(ref), color="0.6", lw=2.5, label=f"{names[0]} (mean)")
        for i, r in enumerate(results[name]):
            h = r["history"]
            ax_loss.plot(_smooth(h["loss"]), lw=1, label=f"seed {i}")
            (line,) = ax_scale.plot(h["scale"], lw=1.5, label=f"seed {i}")
            skipped = np.flatnonzero(h["skipped"])
            ax_scale.plot(
                skipped, h["scale"][skipped], "x", color=line.get_color(), ms=6
            )
        ax_loss.set_title(name)
        ax_loss.set_yscale("log")
        ax_scale.set_yscale("log", base=2)
        ax_scale.set_xlabel("step")
        for ax in (ax_loss, ax_scale):
            ax.grid(alpha=0.3)
        ax_loss.legend(fontsize=8, loc="upper right")
    axes[0, 0].set_ylabel("training loss\n(10-step running mean)")
    axes[1, 0].set_ylabel("loss scale (x: skipped step)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _smooth(x, k=10):
    k = max(1, min(k, len(x)))
    c = np.cumsum(np.insert(np.asarray(x, np.float64), 0, 0.0))
    head = c[1:k] / np.arange(1, k)  # growing window over the first k - 1 steps
    return np.concatenate([head, (c[k:] - c[:-k]) / k])


def parse_args(argv: Sequence[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--steps", type=int, default=None, help="training steps per run (default 600)"
    )
    p.add_argument(
        "--seeds", type=int, default=None, help="seeds per configuration (default 3)"
    )
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("out"),
        help="output folder for the table and the plot (default out/)",
    )
    p.add_argument(
        "--probe-every",
        type=int,
        default=5,
        help="compare the fp16 gradient with the fp32 one every N steps",
    )
    p.add_argument(
        "--loss-weight",
        type=float,
        default=1.0,
        help="differentiate loss_weight * mean loss (default 1); e.g. 2**-8 = "
        "0.00390625 shrinks every gradient as a 256x larger batch's mean would",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short run for the test suite (100 steps, 2 seeds)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 100 if args.quick else 600
    if args.seeds is None:
        args.seeds = 2 if args.quick else 3
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.seeds < 1:
        p.error(f"--seeds must be >= 1, got {args.seeds}")
    if not (np.isfinite(args.loss_weight) and args.loss_weight > 0):
        p.error(f"--loss-weight must be a finite number > 0, got {args.loss_weight}")
    if args.probe_every < 1:
        p.error(f"--probe-every must be >= 1, got {args.probe_every}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t0 = time.perf_counter()
    results, fp32_state, (x_tr, y_tr) = run(
        args.steps,
        args.seeds,
        args.probe_every,
        args.loss_weight,
        progress=not args.no_progress,
    )
    rows = summarize(results)
    table = format_table(rows, args.steps, args.seeds, args.loss_weight)

    x, y = x_tr[:256], y_tr[:256]
    where = where_it_underflows(fp32_state.params, fp32_state.batch_stats, x, y)
    where_table = "\n".join(
        [
            "| setting (trained fp32 weights, 256 samples) "
            "| gradient entries fp16 loses |",
            "|---|---|",
        ]
        + [f"| {k} | {100 * v:.3f}% |" for k, v in where.items()]
    )

    args.out.mkdir(parents=True, exist_ok=True)
    weight = "" if args.loss_weight == 1.0 else f", loss x {args.loss_weight:g}"
    plot(
        results,
        args.out / "digits_plot.png",
        f"digits CNN, {args.steps} steps{weight}: "
        "float32 vs float16 with and without loss scaling",
    )
    (args.out / "digits_table.md").write_text(
        f"{table}\n\nWhere unscaled float16 underflows:\n\n{where_table}\n"
    )
    (args.out / "digits_table.json").write_text(
        json.dumps(dict(rows=rows, underflow_by_setting=where), indent=2)
    )
    print(table)
    print("\nWhere unscaled float16 underflows:\n")
    print(where_table)
    print(
        f"\nwrote {args.out / 'digits_table.md'} and {args.out / 'digits_plot.png'} "
        f"in {time.perf_counter() - t0:.0f} s"
    )
    return dict(rows=rows, where=where, out=args.out, results=results)


if __name__ == "__main__":
    main()
