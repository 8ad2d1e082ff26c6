"""Compiling, running and timing the variants of a case; the allocator children.

``run_case`` compiles every variant of a case, runs them interleaved (the order rotated each
round, so machine noise hits them alike) in one timing mode or both (``MODES``) and refuses a
variant whose loss went non-finite, whose parameters or optimizer state hold a non-finite
value, or whose loss scale moved or that skipped a step. ``run_children`` runs the cases once
per allocator, each in a child process started with the allocator's environment and a
compilation cache shared for the run.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from .hlo import hlo_stats, shape_strings
from .prototypes import tracing
from .report import mb
from .variants import SLOW_PEERS, VARIANTS
from .workloads import INIT_SCALE, WORKLOADS, build_case

# latency: each step blocked on (``block_until_ready``) before the next is dispatched, the
# median step; throughput: ``steps`` steps dispatched back to back, each fed the last one's
# outputs, one block at the end, the time over ``steps`` (what a training loop sees when the
# host queues steps ahead of the device).
MODES = ("latency", "throughput")


def default_modes() -> list[str]:
    """Both modes on an accelerator; latency on CPU, where a step's dispatch is a small part
    of it and the CPU results (results.json, the targets) have always been latency."""
    return list(MODES) if jax.default_backend() != "cpu" else ["latency"]


def log(msg: str) -> None:
    """Progress, to stderr (stdout stays free)."""
    print(msg, file=sys.stderr, flush=True)


def compile_step(
    fn: Callable, args: Sequence, donate: tuple[int, ...] = (0, 1), fresh: bool = False
):
    """``fn`` jitted (``donate_argnums=donate``), lowered for ``args`` and compiled, from
    scratch where ``fresh`` (``jax.clear_caches`` first): ``(compiled, cpu_s, wall_s)``, the
    CPU and wall seconds of trace + lower + compile."""
    if fresh:
        jax.clear_caches()
    c0, w0 = time.process_time(), time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    return compiled, time.process_time() - c0, time.perf_counter() - w0


def rotations(names: Sequence[str], rounds: int) -> Iterator[list[str]]:
    """``names`` once per round, the order rotated by one each round."""
    names = list(names)
    for r in range(rounds):
        yield names[r % len(names) :] + names[: r % len(names)]


def copy_tree(tree):
    return jax.tree_util.tree_map(jnp.copy, tree)


def all_finite(tree) -> bool:
    leaves = [
        x
        for x in jax.tree_util.tree_leaves(tree)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return all(bool(jnp.all(jnp.isfinite(x))) for x in leaves)


HLO_COLUMNS = (
    "conditionals",
    "param_sized_copies",
    "param_sized_selects",
    "kernels",
    "instructions",
    "bytes_moved",
)


def compile_variant(name, case, measure_compile, log) -> dict[str, Any]:
    """Variant ``name`` of the built ``case`` compiled and run once (warm-up): its executable,
    carry, compile times, temporaries and HLO columns, ready for the timed rounds."""
    full, post, init, scale_of = VARIANTS[name](case.loss, case.pattern)
    fn = full if case.kind == "full" else post
    args = (copy_tree(case.params), init(case.params), *case.args)
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    entries = len(os.listdir(cache)) if cache else 0
    # From scratch where measured: no executable or trace kept from an earlier variant.
    with tracing(name):
        compiled, compile_cpu, compile_wall = compile_step(fn, args, fresh=measure_compile)
    # A variant whose HLO equals an earlier one's is read from the compilation cache
    # (nothing new is written): its compile time is not measured.
    measured = measure_compile and not (cache and len(os.listdir(cache)) == entries)
    mem = compiled.memory_analysis()
    out = compiled(*args)  # warm-up step
    jax.block_until_ready(out)
    log(f"  compiled {name:24s} cpu {compile_cpu:7.2f} s  wall {compile_wall:7.2f} s")
    return {
        "compiled": compiled,
        "carry": out[:2],
        "losses": [out[2]] if case.kind == "full" else [],
        "modes": {m: {"times": [], "faults": 0, "round_ms": []} for m in MODES},
        "scale_of": scale_of,
        "compile_cpu_s": compile_cpu if measured else None,
        "compile_wall_s": compile_wall if measured else None,
        "temp_bytes": int(mem.temp_size_in_bytes) if mem else None,
        **hlo_stats(compiled.as_text(), shape_strings(case.params)),
    }


def _refusals(run: dict[str, Any]) -> list[str]:
    refused = []
    if not all(bool(jnp.isfinite(v)) for v in run["losses"]):
        refused.append("loss went non-finite")
    if not all_finite(run["carry"]):
        refused.append("non-finite parameters or optimizer state")
    moved = run["scale_of"](run["carry"][1])
    if moved is not None and (moved[0] != INIT_SCALE or moved[1] != 0):
        refused.append(f"loss scale moved to {moved[0]} / {moved[1]} skipped steps")
    return refused


def _latency(run, args, iters: int, full: bool) -> list[float]:
    """``iters`` steps, each blocked on: their times."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = run["compiled"](*run["carry"], *args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
        run["carry"] = out[:2]
        if full:
            run["losses"].append(out[2])
    return times


def _throughput(run, args, steps: int, full: bool) -> list[float]:
    """``steps`` steps dispatched back to back (each fed the last one's outputs), one block
    at the end: the time per step, once per step (the samples of the round)."""
    t0 = time.perf_counter()
    for _ in range(steps):
        out = run["compiled"](*run["carry"], *args)
        run["carry"] = out[:2]
        if full:
            run["losses"].append(out[2])
    jax.block_until_ready(run["carry"])
    return [(time.perf_counter() - t0) / steps] * steps


def trace_file(folder: Path) -> Path:
    """The Perfetto trace ``jax.profiler.trace(folder, create_perfetto_trace=True)`` wrote."""
    found = sorted(folder.glob("plugins/profile/*/perfetto_trace.json.gz"))
    if not found:
        raise FileNotFoundError(f"jax.profiler wrote no perfetto_trace.json.gz under {folder}")
    return found[-1]


def trace_steps(run: dict[str, Any], args: Sequence, steps: int, folder: Path) -> Path:
    """``steps`` steps of a compiled variant (``compile_variant``'s ``run``), dispatched back
    to back as in throughput mode, inside a ``jax.profiler`` trace of their own written into
    ``folder``: the Perfetto trace's path. The carry goes on from where it was."""
    carry = run["carry"]
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        for _ in range(steps):
            carry = run["compiled"](*carry, *args)[:2]
        jax.block_until_ready(carry)
    run["carry"] = carry
    return trace_file(folder)


def run_case(
    case: str,
    variants: list[str],
    rounds: int,
    iters: int,
    measure_compile: bool,
    log: Callable[[str], None],
    modes: Sequence[str] = ("latency",),
    steps: int | None = None,
    trace: tuple[Path, int] | None = None,
) -> list[dict[str, Any]]:
    """One row per variant of ``case`` and mode (``plain`` among the variants: the ratios are
    to it, round by round in the same mode). Each round runs every variant in turn, each in
    every mode: ``iters`` blocked steps (latency), ``steps`` (default ``iters``) back-to-back
    steps (throughput). ``trace=(folder, n)``: after the rounds, ``n`` steps of each variant in
    a profiler trace of its own under ``folder`` (``trace_steps``), its path in the row's
    ``trace`` (None without)."""
    for m in modes:
        if m not in MODES:
            raise ValueError(f"mode {m!r}: choose from {MODES}.")
    steps = steps or iters
    built = build_case(case)
    leaves = jax.tree_util.tree_leaves(built.params)
    runs = {name: compile_variant(name, built, measure_compile, log) for name in variants}
    full = built.kind == "full"
    timers = {
        "latency": lambda run: _latency(run, built.args, iters, full),
        "throughput": lambda run: _throughput(run, built.args, steps, full),
    }

    for order in rotations(variants, rounds):
        for name in order:
            for m in modes:
                run, rec = runs[name], runs[name]["modes"][m]
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                times = timers[m](run)
                rec["faults"] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
                rec["times"] += times
                rec["round_ms"].append(statistics.median(times) * 1e3)
    if trace is not None:
        folder, n = trace
        for name in variants:
            where = folder / f"{case.replace('/', '_')}.{name}"
            runs[name]["trace"] = str(trace_steps(runs[name], built.args, n, where))

    rows = []
    for m in modes:
        rows += _rows(case, built, leaves, variants, runs, m)
    return rows


def _rows(case, built, leaves, variants, runs, mode: str) -> list[dict[str, Any]]:
    rows = []
    plain_rounds = runs["plain"]["modes"][mode]["round_ms"]
    for name in variants:
        run, rec = runs[name], runs[name]["modes"][mode]
        ratios = [v / p for v, p in zip(rec["round_ms"], plain_rounds, strict=True)]
        rows.append(
            {
                "case": case,
                "workload": built.workload,
                "layout": built.layout,
                "pattern": built.pattern,
                "kind": built.kind,
                "variant": name,
                "mode": mode,
                "params": int(sum(p.size for p in leaves)),
                "leaves": len(leaves),
                "median_ms": statistics.median(rec["times"]) * 1e3,
                "min_ms": min(rec["times"]) * 1e3,
                "ratio": statistics.median(ratios),
                "ratio_lo": min(ratios),
                "ratio_hi": max(ratios),
                "faults_per_step": rec["faults"] / len(rec["times"]),
                "compile_cpu_s": run["compile_cpu_s"],
                "compile_wall_s": run["compile_wall_s"],
                "temp_bytes": run["temp_bytes"],
                **{k: run[k] for k in HLO_COLUMNS},
                "samples": len(rec["times"]),
                "trace": run.get("trace"),
                "refused": "; ".join(_refusals(run)) or None,
            }
        )
    return rows


def run_here(
    cases,
    variants,
    rounds,
    iters,
    measure_compile,
    allocator,
    skip_slow_peers=False,
    modes: Sequence[str] = ("latency",),
    steps: int | None = None,
    trace: tuple[Path, int, Sequence[str]] | None = None,
) -> list[dict[str, Any]]:
    """Every case, in this process, its rows marked with ``allocator``. ``trace=(folder, n,
    kinds)``: the cases of those kinds (``full``, ``post``) traced as ``run_case`` says."""
    jax.jit(lambda a: a * 2 + 1).lower(jnp.ones(3)).compile()  # JAX's one-time costs
    rows = []
    for case in cases:
        log(f"{case} [{allocator}]")
        names = variants
        if skip_slow_peers and WORKLOADS[case.split("/")[0]].get("depth", 0) >= 100:
            names = [v for v in variants if v not in SLOW_PEERS]
        traced = None
        if trace is not None and case.split("/")[-1] in trace[2]:
            traced = (trace[0], trace[1])
        for r in run_case(case, names, rounds, iters, measure_compile, log, modes, steps, traced):
            r["allocator"] = allocator
            flag = f"REFUSED: {r['refused']}" if r["refused"] else ""
            log(
                f"    {r['variant']:24s} {r['mode']:10s} x{r['ratio']:.2f} ({r['ratio_lo']:.2f}-"
                f"{r['ratio_hi']:.2f})  {r['median_ms']:8.2f} ms  "
                f"faults {r['faults_per_step']:7.0f}"
                f"  temp {mb(r['temp_bytes'])} MB {flag}"
            )
            rows.append(r)
    return rows


ALLOCATOR_LIBS = {
    "tcmalloc": ("libtcmalloc_minimal.so.4",),
    "jemalloc": ("libjemalloc.so.2",),
}
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")
ALLOCATORS = ("default", "glibc_tuned", "tcmalloc", "jemalloc")
DEFAULT_ALLOCATORS = ("default", "glibc_tuned", "tcmalloc")


def allocator_env(name: str) -> dict[str, str] | None:
    """The environment that selects an allocator, or None where it is not installed."""
    if name == "default":
        return {}
    if name == "glibc_tuned":
        # One arena: XLA:CPU allocates from its worker threads, and a non-main glibc arena
        # serves a block larger than its 64 MiB heap by mmap whatever MMAP_MAX says.
        return {
            "MALLOC_ARENA_MAX": "1",
            "MALLOC_MMAP_MAX_": "0",
            "MALLOC_TRIM_THRESHOLD_": str(2**30),
        }
    for lib in ALLOCATOR_LIBS.get(name, ()):
        for d in LIB_DIRS:
            path = Path(d) / lib
            if path.exists():
                env = {"LD_PRELOAD": str(path)}
                if name == "jemalloc":
                    env["MALLOC_CONF"] = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
                return env
    return None


def run_children(
    entry: Path,
    cache: str,
    allocators: list[str],
    child_args: list[str],
) -> list[dict[str, Any]]:
    """Rows of ``entry --child FILE *child_args`` run once per allocator, each child started
    with the allocator's environment; the first measures compile times, the later ones read
    the compiled executables from ``cache``."""
    rows: list[dict[str, Any]] = []
    for i, alloc in enumerate(allocators):
        result = Path(cache) / f"rows_{alloc}.json"
        env = {
            **os.environ,
            **allocator_env(alloc),
            "BENCH_ALLOCATOR": alloc,
            "JAX_COMPILATION_CACHE_DIR": cache,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        }
        cmd = [sys.executable, str(entry), "--child", str(result), *child_args]
        if i > 0:
            cmd.append("--no-compile-times")
        settings = " ".join(f"{k}={v}" for k, v in allocator_env(alloc).items())
        log(f"== allocator {alloc}: {settings or '(glibc defaults)'}")
        subprocess.run(cmd, env=env, check=True)
        rows += json.loads(result.read_text())
    return rows
