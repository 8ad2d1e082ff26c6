"""The first call of a training step: trace, lower, compile and one run, against plain Optax.

Each measurement runs in a fresh process (no trace, lowering or compilation cache warm from an
earlier one), the variants alternated (plain, then each of the library's, then plain again, ...),
and each stage's time reported as the median over rounds of its ratio to plain's in the same
round. benchmarks/README.md ("The first call") says what each variant runs; docs/performance.md
quotes the figures.

    python benchmarks/bench_first_call.py                       # gpt_23m and mlp_34m, 3 rounds
    python benchmarks/bench_first_call.py --models tiny --rounds 1   # a smoke run
    python benchmarks/bench_first_call.py --child optax gpt_23m --profile /tmp/p.prof
    python benchmarks/bench_first_call.py --kernels                # distinct kernels compiled
    python benchmarks/bench_first_call.py --calls                  # Python calls of the trace
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

STAGES = ("trace", "lower", "compile", "run", "first_call")
VARIANTS = ("plain", "optax", "fused")
MODELS = ("gpt_23m", "mlp_34m", "tiny")


def _model(name: str) -> tuple[Any, Any, Any]:
    """``(params, batch, loss_fn)``: float32 parameters and a loss computed in their dtype."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)

    def normal(*shape: int, std: float = 0.02) -> jax.Array:
        return jnp.asarray(rng.normal(0.0, std, shape), jnp.float32)

    if name == "mlp_34m" or name == "tiny":
        widths = [1024] + [2048] * 8 + [1024] if name == "mlp_34m" else [16, 32, 32, 8]
        params = {}
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
            params[f"layer{i}"] = {"w": normal(a, b, std=a**-0.5), "b": jnp.zeros(b)}
        x = jnp.asarray(rng.normal(size=(8, widths[0])), jnp.float16)
        y = jnp.asarray(rng.normal(size=(8, widths[-1])), jnp.float16)

        def mlp_loss(p: Any, x: Any, y: Any) -> jax.Array:
            h = x
            layers = list(p.values())
            for i, layer in enumerate(layers):
                h = h @ layer["w"] + layer["b"]
                if i < len(layers) - 1:
                    h = jax.nn.gelu(h)
            return jnp.mean((h - y).astype(jnp.float32) ** 2)

        return params, (x, y), mlp_loss

    # gpt_23m: a decoder-only transformer, d 512, 6 layers, 8 heads, vocabulary 8192 tied to
    # the output, sequence 128, batch 2: 23.1M parameters in 52 leaves.
    d, layers, heads, vocab, seq = 512, 6, 8, 8192, 128
    params = {"wte": normal(vocab, d), "wpe": normal(seq, d), "lnf_g": jnp.ones(d)}
    params["lnf_b"] = jnp.zeros(d)
    for i in range(layers):
        params[f"block{i}"] = {
            "ln1_g": jnp.ones(d), "ln1_b": jnp.zeros(d), "qkv": normal(d, 3 * d),
            "proj": normal(d, d), "ln2_g": jnp.ones(d), "ln2_b": jnp.zeros(d),
            "fc": normal(d, 4 * d), "out": normal(4 * d, d),
        }  # fmt: skip
    tokens = jnp.asarray(rng.integers(0, vocab, (2, seq + 1)), jnp.int32)

    def norm(h: Any, g: Any, b: Any) -> Any:
        h32 = h.astype(jnp.float32)
        mu = h32.mean(-1, keepdims=True)
        var = ((h32 - mu) ** 2).mean(-1, keepdims=True)
        return ((h32 - mu) * jax.lax.rsqrt(var + 1e-5)).astype(h.dtype) * g + b

    def gpt_loss(p: Any, tokens: Any) -> jax.Array:
        x, y = tokens[:, :-1], tokens[:, 1:]
        h = p["wte"][x] + p["wpe"][None]
        mask = jnp.tril(jnp.ones((seq, seq), bool))
        for i in range(layers):
            blk = p[f"block{i}"]
            q, k, v = jnp.split(norm(h, blk["ln1_g"], blk["ln1_b"]) @ blk["qkv"], 3, -1)
            q, k, v = (t.reshape(*t.shape[:2], heads, d // heads) for t in (q, k, v))
            att = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / (d // heads) ** 0.5
            att = jax.nn.softmax(jnp.where(mask, att, -1e9), -1).astype(h.dtype)
            o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(h.shape)
            h = h + o @ blk["proj"]
            m = jax.nn.gelu(norm(h, blk["ln2_g"], blk["ln2_b"]) @ blk["fc"])
            h = h + m @ blk["out"]
        logits = (norm(h, p["lnf_g"], p["lnf_b"]) @ p["wte"].T).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(logp, y[..., None], -1))

    return params, (tokens,), gpt_loss


def _step(variant: str, loss_fn: Any, params: Any) -> tuple[Any, Any]:
    """``(step, opt_state)``: the README's step (``optax``), the same through
    ``lsj.apply_gradients`` (``fused``), or the step without loss scaling (``plain``)."""
    import jax
    import jax.numpy as jnp
    import optax

    f16 = jnp.float16
    if variant == "plain":
        tx = optax.adamw(1e-3)

        def plain(params: Any, opt_state: Any, *batch: Any) -> Any:
            p16 = jax.tree.map(lambda a: a.astype(f16), params)
            loss, grads = jax.value_and_grad(loss_fn)(p16, *batch)
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return plain, tx.init(params)

    import lossscale_jax as lsj

    tx = lsj.loss_scaling(optax.adamw(1e-3), lsj.DynamicScale(init_scale=2.0**15))

    def ours(params: Any, opt_state: Any, *batch: Any) -> Any:
        p16 = jax.tree.map(lambda a: a.astype(f16), params)
        loss, grads = lsj.value_and_grad(loss_fn, opt_state)(p16, *batch)
        if variant == "fused":
            params, opt_state = lsj.apply_gradients(tx, grads, opt_state, params)
            return params, opt_state, loss
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return ours, tx.init(params)


def _built(variant: str, model: str) -> tuple[Any, tuple[Any, ...]]:
    """``(step, args)``: one variant's step on one model and the arguments of its call."""
    params, batch, loss_fn = _model(model)
    step, opt_state = _step(variant, loss_fn, params)
    return step, (params, opt_state, *batch)


def child(variant: str, model: str, profile: str | None = None) -> dict[str, float]:
    """One variant's first call in this process: each stage's seconds."""
    import jax

    step, args = _built(variant, model)
    jax.block_until_ready(args)
    jitted = jax.jit(step)
    times: dict[str, float] = {}
    cpu: dict[str, float] = {}
    profiler = None
    if profile is not None:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t, c = time.perf_counter(), time.process_time()
    traced = jitted.trace(*args)
    times["trace"], cpu["trace"] = time.perf_counter() - t, time.process_time() - c
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    t, c = time.perf_counter(), time.process_time()
    lowered = traced.lower()
    times["lower"], cpu["lower"] = time.perf_counter() - t, time.process_time() - c
    t, c = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    times["compile"], cpu["compile"] = time.perf_counter() - t, time.process_time() - c
    t, c = time.perf_counter(), time.process_time()
    jax.block_until_ready(compiled(*args))
    times["run"], cpu["run"] = time.perf_counter() - t, time.process_time() - c
    times["first_call"] = sum(times[s] for s in STAGES[:-1])
    cpu["first_call"] = sum(cpu[s] for s in STAGES[:-1])
    # The process's CPU time (all its threads): what a loaded machine disturbs least.
    return {**times, **{f"{k}_cpu": v for k, v in cpu.items()}}


KERNEL_EVENT = "FusionCompiler::Compile"
"""The profiler's event for one kernel XLA:CPU compiles (a distinct fused computation; two
alike are compiled once): what the compile costs per kernel, whatever its size."""


def compiled_kernels(lowered: Any) -> int:
    """The distinct kernels XLA:CPU compiles for ``lowered`` (a ``jax.stages.Lowered``),
    counted from a profile of its compile (``KERNEL_EVENT``): the figure of the compile that
    does not scatter with the load. A backend or JAX that records no such event raises
    ``RuntimeError``."""
    import glob
    import tempfile

    import jax
    from jax._src.lib import _profile_data

    with tempfile.TemporaryDirectory() as out:
        with jax.profiler.trace(out):
            lowered.compile()
        (path,) = glob.glob(f"{out}/**/*.xplane.pb", recursive=True)
        data = _profile_data.ProfileData.from_file(path)
        n = sum(
            e.name == KERNEL_EVENT for p in data.planes for line in p.lines for e in line.events
        )
    if n == 0:
        raise RuntimeError(
            f"no {KERNEL_EVENT!r} event in the profile of the compile: this backend or JAX "
            f"(jax {jax.__version__}, {jax.default_backend()}) does not record XLA:CPU's kernels."
        )
    return n


def kernels(variant: str, model: str) -> int:
    """``compiled_kernels`` of one variant's step on one model (in this process: run it in a
    fresh one, as ``--kernels`` does, for a compile no cache has seen)."""
    import jax

    step, args = _built(variant, model)
    return compiled_kernels(jax.jit(step).lower(*args))


def trace_calls(variant: str, model: str) -> int:
    """The Python function calls one variant's step makes while traced (``jax.jit(...).trace``)
    on one model, in this process (``--calls`` runs each in a fresh one): the trace's work as
    a count, which the load does not scatter (its seconds it does, by tens of percent)."""
    import jax

    step, args = _built(variant, model)
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event == "call"

    jitted = jax.jit(step)
    sys.setprofile(count)
    try:
        jitted.trace(*args)
    finally:
        sys.setprofile(None)
    return calls


def _in_child(python: str, platforms: str, *args: str) -> dict[str, Any]:
    """``--child`` (after ``args``' options, then the variant and model) in a fresh process
    of ``python`` on JAX platforms ``platforms``: the JSON its last line prints."""
    *options, variant, model = args
    out = subprocess.run(
        [python, __file__, *options, "--child", variant, model],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": platforms},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(
    models: list[str], variants: list[str], rounds: int, python: str = sys.executable
) -> list[dict[str, Any]]:
    """Each model's variants in fresh processes, alternated, ``rounds`` times: a row per
    (model, variant) with each stage's median seconds and median ratio to plain."""
    rows = []
    for model in models:
        seconds: dict[str, list[dict[str, float]]] = {v: [] for v in ("plain", *variants)}
        for r in range(rounds):
            # plain first in even rounds, last in odd ones: each side sees the load alike
            order = ["plain", *variants] if r % 2 == 0 else [*variants, "plain"]
            for variant in order:
                platforms = os.environ.get("JAX_PLATFORMS", "cpu")
                seconds[variant].append(_in_child(python, platforms, variant, model))
                print(f"  {model} round {r + 1} {variant}: {seconds[variant][-1]}", flush=True)
        for variant in ("plain", *variants):
            row: dict[str, Any] = {"model": model, "variant": variant}
            for stage in [*STAGES, *(f"{s}_cpu" for s in STAGES)]:
                row[f"{stage}_s"] = statistics.median(t[stage] for t in seconds[variant])
                row[f"{stage}_x"] = statistics.median(
                    t[stage] / p[stage]
                    for t, p in zip(seconds[variant], seconds["plain"], strict=True)
                )
            rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], clock: str = "") -> str:
    """A markdown table: plain's seconds, and each variant's ratio to plain per stage
    (``clock``: ``""``, wall-clock time; ``"_cpu"``, the process's CPU time)."""
    out = [
        "| model | variant | first call | trace | lower | compile | run |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        order = [f"{s}{clock}" for s in STAGES[-1:] + STAGES[:-1]]
        if row["variant"] == "plain":
            cells = [f"{row[f'{s}_s']:.2f} s" for s in order]
        else:
            cells = [f"{row[f'{s}_x']:.2f}x" for s in order]
        out.append(f"| {row['model']} | {row['variant']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["gpt_23m", "mlp_34m"])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS[1:], default=list(VARIANTS[1:]))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "MODEL"), help=argparse.SUPPRESS)
    parser.add_argument("--profile", help="with --child: a cProfile of the trace, to this file")
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="instead of timing: the distinct kernels XLA:CPU compiles for each step",
    )
    parser.add_argument(
        "--calls",
        action="store_true",
        help="instead of timing: the Python calls each step's trace makes, and their ratio",
    )
    args = parser.parse_args(argv)
    if args.child:
        if args.kernels:
            print(json.dumps({"kernels": kernels(*args.child)}))
            return
        if args.calls:
            print(json.dumps({"calls": trace_calls(*args.child)}))
            return
        print(json.dumps(child(*args.child, profile=args.profile)))
        return
    import jax

    if args.kernels:
        print("| model | " + " | ".join(("plain", *args.variants)) + " |")
        print("|---|" + "---:|" * (1 + len(args.variants)))
        for model in args.models:
            counts = [
                _in_child(sys.executable, "cpu", "--kernels", v, model)["kernels"]
                for v in ("plain", *args.variants)
            ]
            print(f"| {model} | " + " | ".join(str(c) for c in counts) + " |")
        return

    if args.calls:
        print("| model | plain | " + " | ".join(args.variants) + " |")
        print("|---|" + "---:|" * (1 + len(args.variants)))
        for model in args.models:
            counts = [
                _in_child(sys.executable, "cpu", "--calls", v, model)["calls"]
                for v in ("plain", *args.variants)
            ]
            cells = [f"{c:,} ({c / counts[0]:.2f}x)" for c in counts[1:]]
            print(f"| {model} | {counts[0]:,} | " + " | ".join(cells) + " |")
        return

    load = os.getloadavg()[0]
    print(f"jax {jax.__version__}, Python {sys.version.split()[0]}, load average {load:.1f}")
    rows = measure(args.models, args.variants, args.rounds)
    after = os.getloadavg()[0]
    print(f"load average before / after: {load:.1f} / {after:.1f}")
    print("wall-clock time:")
    print(table(rows))
    print("CPU time of the process:")
    print(table(rows, "_cpu"))
    if args.json:
        meta = {"jax": jax.__version__, "python": sys.version.split()[0], "load": [load, after]}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
