"""Per-layer loss scaling where one global scale cannot serve the whole network.

A wide & deep model (Cheng et al., 2016: a linear "wide" part beside a deep MLP,
their logits added) learns scikit-learn's digits. The deep part is a plain MLP (no
normalisation, no residuals) whose sigmoid layers with Glorot's standard
initialisation are Glorot & Bengio's (2010) vanishing-gradient setting: each layer
multiplies the backward signal by about a quarter (the sigmoid's slope is at most
1/4), so the layers' gradients shrink by about two octaves per layer from the loss
towards the input. Over the 20 layers used here they span more than float16's window
(2**-24 .. 65504, about 40 octaves): ``lsj.diagnose`` measures it first
(``OUT/layerwise_diagnosis.txt``). The wide part keeps the model trainable in float32
at that depth (a deep plain MLP alone does not train there).

Four configurations, the same seeds and batches:

- ``fp32``: float32 compute, Adam, the reference;
- ``fp16_dynamic``: float16 compute on float32 master weights, ``lsj.loss_scaling``
  with ``DynamicScale``;
- ``fp16_headroom``: the same with ``HeadroomScale``, reading the layer taps;
- ``fp16_layerwise``: ``lsj.layerwise_scaling``: one scale per layer.

Every ``--probe-every`` steps the float16 gradient the optimizer receives (the
scaled gradient divided by its scale: per leaf, by its layer's scale for the
per-layer run) is compared with the float32 gradient of the same weights on the
same batch: an entry non-zero in float32 but zero in float16 was lost to
underflow (``lost_fraction``).

Output in ``OUT`` (``--out``, default ``out``): ``layerwise_results.json`` (one
row per configuration and seed: validation loss, skipped-step fraction, lost
fraction), ``layerwise_table.md`` (mean ± std over seeds),
``layerwise_scales.png`` (each layer's scale over training, log2) and
``layerwise_diagnosis.txt``.

Run: ``python examples/train_layerwise.py [--steps N] [--seeds K] [--out DIR]``
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import pathlib
import time
from collections.abc import Sequence
from contextlib import redirect_stdout
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import lossscale_jax as lsj

F16, F32 = jnp.float16, jnp.float32

DEPTH = 20  # hidden layers of the deep part
WIDTH = 32
GAIN = 1.0  # Glorot-normal, as it comes
ACTIVATION = "sigmoid"
BATCH = 64
LR = 3e-3
CONFIGS = ("fp32", "fp16_dynamic", "fp16_headroom", "fp16_layerwise")


# --------------------------------------------------------------------------
# Data and model.


def load_data(seed: int = 0):
    """Digits as (N, 64) float32 in [0, 1]; a stratified 75/25 split."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_tr, x_va, y_tr, y_va = train_test_split(
        x, y, test_size=0.25, random_state=seed, stratify=y
    )
    return x_tr, y_tr, jnp.asarray(x_va), jnp.asarray(y_va)


def init_params(seed: int, depth: int, width: int, gain: float) -> list[dict]:
    """The deep part's layers (Glorot-normal weights, times ``gain`` in the hidden
    layers; zero biases), its head, then the wide part (a linear map of the input)."""
    dims = [64] + [width] * depth + [10]
    wide_key = jax.random.fold_in(jax.random.key(seed), 10_000)
    wide = {"w": jax.random.normal(wide_key, (64, 10), F32) * (1.0 / 64) ** 0.5}
    params = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        key = jax.random.fold_in(jax.random.key(seed), i)
        std = (2.0 / (a + b)) ** 0.5 * (gain if i < depth else 1.0)
        params.append(
            {"w": jax.random.normal(key, (a, b), F32) * std, "b": jnp.zeros(b, F32)}
        )
    return [*params, wide]


def make_loss(dtype: Any, activation: str):
    """``loss(params, (x, y))``: the model in ``dtype`` on float32 master weights, each
    hidden layer's output tapped (``lsj.tap``), the deep part's logits plus the wide
    part's, the cross-entropy in float32."""
    act = {"sigmoid": jax.nn.sigmoid, "tanh": jnp.tanh}[activation]

    def loss(params, batch):
        x, y = batch
        h = x.astype(dtype)
        *hidden, head, wide = params
        inputs = h
        for i, p in enumerate(hidden):
            w, b = p["w"].astype(dtype), p["b"].astype(dtype)
            h = lsj.tap(act(h @ w + b), f"layer{i:02d}")
        deep = h @ head["w"].astype(dtype) + head["b"].astype(dtype)
        logits = (deep + inputs @ wide["w"].astype(dtype)).astype(F32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss


# --------------------------------------------------------------------------
# The configurations. Each step is one jitted function per configuration.


def make_tx(config: str, lr: float, layers: Any) -> optax.GradientTransformation:
    adam = optax.adam(lr)
    if config == "fp32":
        return adam
    if config == "fp16_dynamic":
        return lsj.loss_scaling(adam, lsj.DynamicScale(growth_interval=200))
    if config == "fp16_headroom":
        return lsj.loss_scaling(adam, lsj.HeadroomScale())
    # The deepest layers need scales far above 2**24: float32 is the ceiling.
    return lsj.layerwise_scaling(adam, layers, lsj.HeadroomScale(max_scale=2.0**100))


def unscaled(config: str, grads: Any, opt_state: Any, layers: Any) -> Any:
    """The gradient ``tx.update`` hands Adam: ``grads`` divided by its scale(s)."""
    if config == "fp16_layerwise":
        scales = opt_state.layers.scale
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        out = [
            g.astype(F32) / scales[s]
            for g, s in zip(leaves, layers.segments, strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, out)
    scale = lsj.get_loss_scale_state(opt_state).scale
    return jax.tree_util.tree_map(lambda g: g.astype(F32) / scale, grads)


def lost_entries(g16: Any, g32: Any) -> tuple[jax.Array, jax.Array]:
    """(#entries zero in ``g16`` but not in ``g32``, #entries non-zero in ``g32``)."""
    pairs = list(
        zip(jax.tree_util.tree_leaves(g16), jax.tree_util.tree_leaves(g32), strict=True)
    )
    lost = sum(jnp.sum((a == 0) & (b != 0), dtype=jnp.int32) for a, b in pairs)
    nonzero = sum(jnp.sum(b != 0, dtype=jnp.int32) for _, b in pairs)
    return lost, nonzero


def make_step(config: str, tx: Any, layers: Any, activation: str):
    """The step: ``(params, opt_state, lost, nonzero)``, counted if ``probe``."""
    loss32 = make_loss(F32, activation)
    loss16 = make_loss(F16, activation)

    @functools.partial(jax.jit, static_argnums=3)
    def step(params, opt_state, batch, probe: bool):
        if config == "fp32":
            grads = jax.grad(loss32)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            zero = jnp.zeros([], jnp.int32)
            return optax.apply_updates(params, updates), opt_state, zero, zero

        def scaled(p):
            return lsj.scale_loss(loss16(p, batch), opt_state)

        if config == "fp16_dynamic":
            grads = jax.grad(scaled)(params)
            taps = None
        elif config == "fp16_headroom":
            _, grads, taps = lsj.taps.value_and_grad(scaled)(params)
        else:
            _, grads, taps = lsj.layerwise.value_and_grad(scaled, layers, opt_state)(
                params
            )
        if probe:
            lost, nonzero = lost_entries(
                unscaled(config, grads, opt_state, layers),
                jax.grad(loss32)(params, batch),
            )
        else:
            lost = nonzero = jnp.zeros([], jnp.int32)
        kw = {} if taps is None else {"taps": taps}
        params, opt_state = lsj.apply_gradients(tx, grads, opt_state, params, **kw)
        return params, opt_state, lost, nonzero

    return step


def log2_scales(config: str, opt_state: Any, n_layers: int) -> jax.Array:
    """Each layer's scale (log2): its own in the per-layer run, else the loss's."""
    if config == "fp32":
        return jnp.zeros([n_layers + 1])
    if config == "fp16_layerwise":
        return jnp.log2(opt_state.layers.scale)
    return jnp.full([n_layers + 1], jnp.log2(lsj.get_loss_scale_state(opt_state).scale))


# --------------------------------------------------------------------------
# The job.


def diagnosis(args, data) -> tuple[str, float]:
    """``lsj.diagnose`` on the initial weights of seed 0: its report and the span of
    the per-leaf max |g| (float32 reference) in octaves."""
    x_tr, y_tr, _, _ = data
    params = init_params(0, args.depth, args.width, args.gain)
    batches = [
        (jnp.asarray(x_tr[i : i + BATCH]), jnp.asarray(y_tr[i : i + BATCH]))
        for i in range(0, 4 * BATCH, BATCH)
    ]
    loss16 = make_loss(F16, args.activation)
    buf = io.StringIO()
    with redirect_stdout(buf):
        d = lsj.diagnose(loss16, params, batches)
    g32 = jax.grad(make_loss(F32, args.activation))(params, batches[0])
    maxima = [float(jnp.max(jnp.abs(p["w"]))) for p in g32]
    log2 = np.log2(maxima)
    lines = [
        "per-layer max |g| of the weights, float32 reference, first batch (log2):",
        *(f"  layer {i:2d}: {v:7.1f}" for i, v in enumerate(log2)),
        f"span: {log2.max() - log2.min():.1f} octaves "
        "(float16's window, 2**-24 .. 65504: about 40)",
        "",
        buf.getvalue(),
    ]
    del d
    return "\n".join(lines), float(log2.max() - log2.min())


def run(args) -> dict[str, Any]:
    data = load_data()
    x_tr, y_tr, x_va, y_va = data
    loss32 = jax.jit(make_loss(F32, args.activation))
    params0 = init_params(0, args.depth, args.width, args.gain)
    batch0 = (jnp.asarray(x_tr[:BATCH]), jnp.asarray(y_tr[:BATCH]))
    layers = lsj.layerwise.discover(make_loss(F16, args.activation), params0, batch0)
    n = len(layers.names)
    rows, scales = [], {}
    for config in CONFIGS:
        tx = make_tx(config, args.lr, layers)
        step = make_step(config, tx, layers, args.activation)
        for seed in range(args.seeds):
            t0 = time.time()
            params = init_params(seed, args.depth, args.width, args.gain)
            opt_state = tx.init(params)
            rng = np.random.default_rng(seed)
            lost = nonzero = 0
            hist = []
            probes = []
            for t in range(args.steps):
                idx = rng.integers(0, len(x_tr), BATCH)
                batch = (jnp.asarray(x_tr[idx]), jnp.asarray(y_tr[idx]))
                probe = t % args.probe_every == 0 and config != "fp32"
                if seed == 0:
                    hist.append(log2_scales(config, opt_state, n))
                params, opt_state, lo, nz = step(params, opt_state, batch, probe)
                if probe:
                    probes.append((lo, nz))
            if probes:
                lost = int(sum(int(a) for a, _ in probes))
                nonzero = int(sum(int(b) for _, b in probes))
            skipped = (
                0 if config == "fp32" else int(lsj.metrics(opt_state)["skipped_steps"])
            )
            row = dict(
                config=config,
                seed=seed,
                val_loss=float(loss32(params, (x_va, y_va))),
                skipped_fraction=skipped / args.steps,
                lost_fraction=lost / nonzero if nonzero else 0.0,
            )
            rows.append(row)
            if seed == 0:
                scales[config] = np.asarray(jnp.stack(hist))
            if args.progress:
                print(
                    f"{config} seed {seed}: {row} ({time.time() - t0:.1f} s)",
                    flush=True,
                )
    return dict(rows=rows, scales=scales, names=[*layers.names, "loss"])


def table(rows: Sequence[dict]) -> str:
    """Mean ± std over seeds per configuration, as markdown."""
    out = [
        "| config | val loss | skipped steps | lost to underflow |",
        "|---|---|---|---|",
    ]
    for config in CONFIGS:
        rs = [r for r in rows if r["config"] == config]
        v = np.array([r["val_loss"] for r in rs])
        s = np.array([r["skipped_fraction"] for r in rs])
        lo = np.array([r["lost_fraction"] for r in rs])
        out.append(
            f"| `{config}` | {v.mean():.4f} ± {v.std():.4f} | {100 * s.mean():.2f}% "
            f"| {100 * lo.mean():.2f}% ± {100 * lo.std():.2f}% |"
        )
    return "\n".join(out) + "\n"


def plot(
    scales: dict[str, np.ndarray], names: Sequence[str], path: pathlib.Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import Normalize

    # Fonts sized for a figure shown about 750 pixels wide (a documentation page); the
    # layers' colours are read off a colour bar and the legend sits below the axes, so
    # neither covers a curve.
    with plt.rc_context({"font.size": 13, "legend.fontsize": 12}):
        fig, ax = plt.subplots(figsize=(9, 6), layout="constrained")
        lw = scales["fp16_layerwise"]
        cmap = plt.get_cmap("viridis")
        for j in range(len(names)):
            ax.plot(lw[:, j], color=cmap(j / max(len(names) - 1, 1)), lw=1)
        for config, style in (("fp16_dynamic", "--"), ("fp16_headroom", ":")):
            ax.plot(scales[config][:, 0], "k" + style, lw=2, label=f"{config} (global)")
        ax.set_xlabel("step")
        ax.set_ylabel("log2 scale")
        ax.set_title("Per-layer scales (fp16_layerwise) and the global scales")
        bar = fig.colorbar(
            plt.cm.ScalarMappable(Normalize(0, len(names) - 1), cmap), ax=ax, pad=0.01
        )
        bar.set_ticks([0, len(names) - 1], labels=[names[0], names[-1]])
        bar.set_label("per-layer scale: layer, input to loss")
        fig.legend(loc="outside lower center", ncols=2)
        fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--probe-every", type=int, default=25)
    p.add_argument("--depth", type=int, default=DEPTH)
    p.add_argument("--width", type=int, default=WIDTH)
    p.add_argument("--gain", type=float, default=GAIN)
    p.add_argument("--activation", choices=("sigmoid", "tanh"), default=ACTIVATION)
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--out", default="out")
    p.add_argument(
        "--quick", action="store_true", help="a smoke run: 4 layers, 30 steps, 2 seeds"
    )
    p.add_argument("--no-progress", dest="progress", action="store_false")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.probe_every, args.depth = 30, 2, 15, 4
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = load_data()
    report, span = diagnosis(args, data)
    (out / "layerwise_diagnosis.txt").write_text(report)
    print(report.split("\n\n")[0])
    res = run(args)
    (out / "layerwise_results.json").write_text(
        json.dumps(res["rows"], indent=1) + "\n"
    )
    md = table(res["rows"])
    (out / "layerwise_table.md").write_text(md)
    print(md)
    plot(res["scales"], res["names"], out / "layerwise_scales.png")
    return dict(rows=res["rows"], span=span, table=md)


if __name__ == "__main__":
    main()
