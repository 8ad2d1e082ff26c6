"""Cost of loss scaling per training step, against the plain step a user runs and the JAX peers.

``python benchmarks/bench_step.py [flags]`` runs ``main``: it measures the cases (once per
allocator, each in a child process, or in this process for ``--quick``), adds the two
breakdowns on the default run or with ``--check-report``, and writes ``results.json``,
``results.md`` and, for a default run into ``benchmarks/``, the marked blocks of
docs/performance.md (``--render`` rewrites those from ``results.json`` without measuring).

``--gpu-results PATH`` is the accelerator's run (``gpu``), ``--profile DIR`` the kernels of
each step (``profiling``), ``--compile-for GPU`` a GPU's program without one (``deviceless``),
``--underflow`` what plain's float16 backward pass loses (``underflow``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import optax

from . import deviceless, gpu, underflow
from .breakdowns import check_report, compile_report
from .harness import (
    ALLOCATORS,
    DEFAULT_ALLOCATORS,
    MODES,
    allocator_env,
    default_modes,
    log,
    run_children,
    run_here,
)
from .profiling import profile
from .report import (
    DOC_PAGES,
    HEADLINE,
    markdown,
    replace_block,
    targets,
    update_docs,
)
from .variants import DEFAULT_VARIANTS, VARIANTS, available
from .workloads import DEFAULT_CASES, GPU_CASES, QUICK_CASES, check_case

BENCHMARKS = Path(__file__).resolve().parent.parent  # the default --out
ENTRY = BENCHMARKS / "bench_step.py"  # the one command; the allocator children run it too
COMMAND = "python benchmarks/bench_step.py"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny cases, in-process (smoke run)")
    ap.add_argument("--cases", nargs="*", default=None, help="workload/layout/pattern/step")
    ap.add_argument("--variants", nargs="*", default=None)
    ap.add_argument("--allocators", nargs="*", default=None, choices=ALLOCATORS)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument(
        "--iters", type=int, default=None, help="blocked steps per variant per round (latency)"
    )
    ap.add_argument(
        "--modes",
        nargs="+",
        default=None,
        choices=MODES,
        help="latency: each step blocked on; throughput: steps dispatched back to back, one "
        "block at the end (default: both on an accelerator, latency on CPU)",
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="back-to-back steps per variant per round (throughput; default 30 for "
        "--gpu-results, else --iters)",
    )
    ap.add_argument(
        "--gpu-results",
        default=None,
        metavar="PATH",
        help="the accelerator's run: the language model (lm_185m), the GPU variants, both "
        "modes, in this process; writes PATH (JSON) and PATH with .md, nothing else",
    )
    ap.add_argument(
        "--device-steps",
        type=int,
        default=None,
        help="with --gpu-results: each step's device time, from N steps per variant in a "
        "profiler trace after the timed rounds (default 20; 0: none)",
    )
    ap.add_argument(
        "--label",
        default=None,
        help="with --gpu-results: what was measured (machine, version of the package), "
        "written into the JSON's meta and the table",
    )
    ap.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="per-kernel times instead of timings: --cases x --variants (default: the GPU "
        "cases' full step; plain, the library's Optax and fused steps and the peers), --steps "
        "steps each (default 10) in a jax.profiler trace; writes DIR/kernels.json and the "
        "traces. With --gpu-results: its traces and their kernels.json kept there",
    )
    ap.add_argument(
        "--compile-for",
        default=None,
        metavar="GPU",
        help="no timing, no GPU: --cases x --variants (default: the GPU cases; plain, "
        "plain_scaled, ours, the conditional forced, the peers) compiled for the described GPU "
        "(h100) by JAX's CUDA plugin; writes compiled_GPU.json and .md into --out",
    )
    ap.add_argument(
        "--underflow",
        nargs="?",
        const="all",
        default=None,
        choices=("all", "logits"),
        help="no timing: the gradient entries the plain step's float16 backward pass loses to "
        "underflow on --cases (default: the GPU cases' full step), and a language model's "
        "logits' gradient (logits: that only, which fits a CPU); underflow.json into --out",
    )
    ap.add_argument(
        "--hlo-dir",
        default=None,
        metavar="DIR",
        help="with --compile-for: each step's optimized HLO text into DIR",
    )
    ap.add_argument(
        "--check-report",
        action="store_true",
        help="time the check formulations and take the compile time apart (default run: on)",
    )
    ap.add_argument("--out", default=str(BENCHMARKS), help="folder for results.json and results.md")
    ap.add_argument(
        "--render",
        action="store_true",
        help="rewrite results.md and the docs blocks from results.json (no measuring)",
    )
    ap.add_argument(
        "--skip-slow-peers",
        action="store_true",
        help="leave jmp and Flax out of the 300-leaf cases (their compiles take minutes each)",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # JSON file to write
    ap.add_argument("--no-compile-times", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _available(names: list[str]) -> tuple[list[str], list[str]]:
    """The variants whose packages are installed, and a line for each one skipped (logged)."""
    kept, missing = available(names)
    skipped = [f"{n} (the package {p} is not installed)" for n, p in missing.items()]
    for n, p in missing.items():
        log(f"skipping variant {n}: the package {p} is not installed")
    return kept, skipped


def _cases_and_variants(cases: list[str], names: list[str]) -> tuple[list[str], list[str]]:
    """The cases, checked, and the variants: known, plain first, those installed."""
    for case in cases:
        check_case(case)
    for name in names:
        if name not in VARIANTS:
            raise ValueError(f"--variants: unknown variant {name!r}; choose from {list(VARIANTS)}.")
    variants, _ = _available(["plain"] + [v for v in names if v != "plain"])
    return cases, variants


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """The one command; returns the rows it measured (or rendered)."""
    args = parse_args(argv)
    if args.gpu_results:
        return gpu.main(args, " ".join([COMMAND, *(argv if argv is not None else sys.argv[1:])]))
    for flag in ("device_steps", "label"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} goes with --gpu-results.")
    if args.profile:
        return profile_main(args)
    if args.compile_for:
        return compile_main(args, argv)
    if args.underflow:
        cases = args.cases or [c for c in GPU_CASES if c.endswith("/full")]
        checked = _cases_and_variants(cases, [])[0]
        return underflow.report(checked, Path(args.out), log, args.underflow == "all")
    cases, variants = _cases_and_variants(
        args.cases or list(QUICK_CASES if args.quick else DEFAULT_CASES),
        args.variants or list(DEFAULT_VARIANTS),
    )
    rounds = args.rounds or (2 if args.quick else 7)
    iters = args.iters or (2 if args.quick else 3)

    if args.render:
        saved = json.loads((Path(args.out) / "results.json").read_text())
        (Path(args.out) / "results.md").write_text(markdown(saved["rows"], saved["meta"]))
        if Path(args.out).resolve() == BENCHMARKS:
            log(f"updated the docs' blocks: {update_docs(saved['rows'], saved['meta'])}")
        return saved["rows"]

    if args.child:  # one allocator, in this process, rows to a file
        rows = run_here(
            cases,
            variants,
            rounds,
            iters,
            not args.no_compile_times,
            os.environ.get("BENCH_ALLOCATOR", "default"),
            args.skip_slow_peers,
            args.modes or default_modes(),
            args.steps,
        )
        Path(args.child).write_text(json.dumps(rows))
        return rows

    t_start, load_before = time.perf_counter(), _load()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = args.allocators or (["default"] if args.quick else list(DEFAULT_ALLOCATORS))
    allocators = [a for a in wanted if allocator_env(a) is not None]
    missing = [a for a in wanted if a not in allocators]
    if args.quick and allocators == ["default"]:
        # A smoke run: no compile times (they would need every cache cleared).
        modes = args.modes or default_modes()
        rows = run_here(cases, variants, rounds, iters, False, "default", False, modes, args.steps)
    else:
        child_args = ["--cases", *cases, "--variants", *variants]
        child_args += ["--rounds", str(rounds), "--iters", str(iters)]
        child_args += ["--skip-slow-peers"] if args.skip_slow_peers else []
        # The children choose the default modes: this process leaves the accelerator alone.
        child_args += ["--modes", *args.modes] if args.modes else []
        child_args += ["--steps", str(args.steps)] if args.steps else []
        cache = tempfile.mkdtemp(prefix="bench_step_cache_")
        try:
            rows = run_children(ENTRY, cache, allocators, child_args)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    default_run = not (args.quick or args.cases or args.variants or args.skip_slow_peers)
    breakdowns = args.check_report or default_run
    report = check_report(max(rounds, 5), log) if breakdowns else None
    compiles = compile_report("deep_300", log) if breakdowns else None
    meta = {
        "command": " ".join([COMMAND, *(argv if argv is not None else sys.argv[1:])]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {jax.devices()[0].platform}",
        "jax": jax.__version__,
        "optax": optax.__version__,
        "load_before": load_before,
        "load_after": _load(),
        "wall_s": time.perf_counter() - t_start,
        "rounds": rounds,
        "iters": iters,
        "allocators": allocators,
        "missing": missing,
        "check_report": report,
        "compile_report": compiles,
    }
    backend = jax.devices()[0].platform
    stem = "results"
    if backend != "cpu" and out.resolve() == BENCHMARKS:
        # The committed results.json/.md and the docs' tables are the CPU run's: a run on an
        # accelerator writes beside them (--gpu-results is the GPU table's own format).
        stem = f"results_{backend}_cpu_format"
        log(f"not a CPU run ({backend}): writing {stem}.json/.md, the CPU results untouched")
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / f"{stem}.md").write_text(markdown(rows, meta))
    if (
        stem == "results"
        and not args.quick
        and out.resolve() == BENCHMARKS
        and set(HEADLINE) <= set(cases)
    ):
        log(f"updated the docs' blocks: {update_docs(rows, meta)}")
    log("\nTarget by target:")
    for t, m, ok in targets(rows, allocators):
        log(f"  [{ok.strip('*'):7s}] {t}: {m}")
    for r in rows:
        if r["refused"]:
            log(f"  REFUSED {r['allocator']} {r['case']} {r['variant']}: {r['refused']}")
    log(
        f"wrote {out / 'results.json'} and {out / 'results.md'} "
        f"({time.perf_counter() - t_start:.0f} s)"
    )
    return rows


PROFILED = (
    "plain",
    "plain_scaled",
    "lsj_optax_ieee",
    "lsj_fused_ieee",
    "jmp",
    "flax",
    "optax_if_finite",
    "where_skip",
)


def compile_main(args: argparse.Namespace, argv: list[str] | None) -> list[dict[str, Any]]:
    """``--compile-for GPU``: the HLO columns of each case's variants compiled for that GPU
    (see ``deviceless``), into ``--out``; every variant, jmp's too (its package is needed).
    With ``--render``: the tables again from ``compiled_GPU.json``, nothing compiled."""
    out = Path(args.out)
    if args.render:
        saved = json.loads((out / f"compiled_{args.compile_for}.json").read_text())
        rows, command, version = saved["rows"], saved["meta"]["command"], saved["meta"]["jax"]
    else:
        cases, variants = _cases_and_variants(
            args.cases or list(GPU_CASES), args.variants or list(deviceless.COMPILED)
        )
        hlo_dir = Path(args.hlo_dir) if args.hlo_dir else None
        log(f"compiling for {args.compile_for} (XLA:GPU, no GPU): {cases} x {variants}")
        rows = deviceless.compile_for(args.compile_for, cases, variants, hlo_dir, log)
        command = " ".join([COMMAND, *(argv if argv is not None else sys.argv[1:])])
        version = jax.__version__
    path = deviceless.write(rows, args.compile_for, command, out, version)
    log(f"wrote {path} and {path.with_suffix('.md')}")
    if out.resolve() == BENCHMARKS:  # the committed table: the docs quote it
        doc = DOC_PAGES[0]
        name = f"compiled_{args.compile_for}"
        table = deviceless.summary(rows, args.compile_for, version)
        text = replace_block(doc.read_text(), name, table)
        if text is not None:
            doc.write_text(text)
            log(f"updated the {name} block of {doc}")
    return rows


def profile_main(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--profile DIR``: each case's variants, kernel by kernel (see ``profiling``); one row
    per case and variant: its device time per step and the ratio to plain's."""
    cases, variants = _cases_and_variants(
        args.cases or [c for c in GPU_CASES if c.endswith("/full")],
        args.variants or list(PROFILED),
    )
    doc = profile(cases, variants, args.steps or 10, Path(args.profile))
    rows = []
    for case, per_variant in doc["cases"].items():
        plain_us = per_variant["plain"]["us_per_step"]
        for variant, summary in per_variant.items():
            ratio = summary["us_per_step"] / plain_us if plain_us else float("nan")
            rows.append({"case": case, "variant": variant, "ratio": ratio, **summary})
            log(
                f"{case} {variant:24s} {summary['us_per_step']:10.1f} us/step (the busiest "
                f"{summary['events']} track)  x{ratio:.3f} plain"
            )
    log(f"wrote {Path(args.profile) / 'kernels.json'} and a trace per variant")
    return rows
