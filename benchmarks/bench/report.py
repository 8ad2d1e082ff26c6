"""What a run writes: results.md, the target-by-target check, the blocks of docs/performance.md
(``gpu`` writes the GPU results' files).

Everything here reads rows and ``meta`` only (as ``results.json`` holds them), so ``--render``
rewrites the same files from a saved run without measuring.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .variants import PEERS
from .workloads import DEFAULT_CASES

DOCS = Path(__file__).resolve().parent.parent.parent / "docs" / "performance.md"
DOC_PAGES = (DOCS, DOCS.parent / "benchmarks.md")

# (label, variants, step, bar): ratio bars on the headline cases. A bar of None is a figure the
# check prints without a target: the Optax path on XLA:CPU, whose floor (the update tree the
# conditional returns, written and read back) docs/performance.md shows; it is kept no worse.
RATIO_TARGETS: tuple[tuple[str, tuple[str, ...], str, float | None], ...] = (
    ("fused", ("lsj_fused_ieee", "lsj_fused_saturating"), "full", 1.10),
    ("fused", ("lsj_fused_ieee", "lsj_fused_saturating"), "post", 1.30),
    ("Optax path", ("lsj_optax_ieee", "lsj_optax_saturating"), "full", None),
    ("Optax path", ("lsj_optax_ieee", "lsj_optax_saturating"), "post", None),
)
HEADLINE = tuple(c for c in DEFAULT_CASES if "/in_out/fp16grad/" in c)


def latency(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The latency rows (a row from before the modes has none: latency)."""
    return [r for r in rows if r.get("mode", "latency") == "latency"]


def targets(rows: list[dict[str, Any]], allocators: list[str]) -> list[tuple[str, str, str]]:
    """(target, measured, met) for every target the run covers (latency rows)."""
    rows = latency(rows)
    out = []
    by = {(r["allocator"], r["case"], r["variant"]): r for r in rows}
    cases = [c for c in HEADLINE if any(r["case"] == c for r in rows)]
    for alloc in allocators:
        for label, names, kind, bar in RATIO_TARGETS:
            for case in [c for c in cases if c.endswith("/" + kind)]:
                got = [by.get((alloc, case, n)) for n in names]
                got = [g for g in got if g is not None]
                if not got:
                    continue
                bad = [g for g in got if g["refused"]]
                text = ", ".join(
                    f"{g['variant'].rsplit('_', 1)[1]} {g['ratio']:.2f}x"
                    f" ({g['ratio_lo']:.2f}-{g['ratio_hi']:.2f})"
                    for g in got
                )
                where = f"{case.split('/')[0]}, {alloc}"
                if bar is None:  # a figure, no target (RATIO_TARGETS says why)
                    met = "refused" if bad else "figure"
                    out.append((f"{label} {kind}, no target (its floor), {where}", text, met))
                    continue
                met = (
                    "refused"
                    if bad
                    else ("yes" if all(g["ratio"] <= bar for g in got) else "**no**")
                )
                out.append((f"{label} {kind} <= {bar:.2f}x, {where}", text, met))
        for case in cases:
            ours = [
                r
                for (a, c, v), r in by.items()
                if a == alloc and c == case and v.startswith("lsj_")
            ]
            peers = [by[(alloc, case, p)] for p in PEERS if (alloc, case, p) in by]
            if not ours or not peers:
                continue
            best_peer = min(peers, key=lambda r: r["median_ms"])
            worst = max(ours, key=lambda r: r["ratio"])
            ok = all(o["ratio"] < p["ratio"] for o in ours for p in peers)
            out.append(
                (
                    f"ahead of jmp, Flax, apply_if_finite: {case}, {alloc}",
                    f"slowest ours {worst['variant']} {worst['ratio']:.2f}x, "
                    f"fastest peer {best_peer['variant']} {best_peer['ratio']:.2f}x",
                    "yes" if ok else "**no**",
                )
            )
    first = [r for r in rows if r["compile_cpu_s"] is not None]
    for case in cases:
        plain = next((r for r in first if r["case"] == case and r["variant"] == "plain"), None)
        if plain is None:
            continue
        for r in first:
            if r["case"] == case and r["variant"].startswith("lsj_"):
                ratio = r["compile_cpu_s"] / plain["compile_cpu_s"]
                out.append(
                    (
                        f"compile <= 2x plain: {r['variant']}, {case.split('/')[0]} {r['kind']}",
                        f"{ratio:.2f}x ({r['compile_cpu_s']:.2f} vs {plain['compile_cpu_s']:.2f} "
                        "CPU s)",
                        "yes" if ratio <= 2.0 else "**no**",
                    )
                )
        for r in first:
            if r["case"] == case and r["variant"].startswith("lsj_"):
                extra = (r["temp_bytes"] - plain["temp_bytes"]) / r["params"]
                out.append(
                    (
                        f"temporaries <= plain + 1 B/param: {r['variant']}, "
                        f"{case.split('/')[0]} {r['kind']}",
                        f"{extra:+.2f} B/param",
                        "yes" if extra <= 1.0 else "**no**",
                    )
                )
    return out


def mb(b):
    return "" if b is None else f"{b / 2**20:.1f}"


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """results.md: a table per case from the latency rows (the targets are latency), then
    the throughput rows where the run has them."""
    thr = [r for r in rows if r.get("mode") == "throughput"]
    rows = latency(rows)
    lines = [
        "<!-- Generated by benchmarks/bench_step.py; do not edit by hand. -->",
        "# Benchmark results",
        "",
        f"Command: `{meta['command'].strip()}`  ",
        f"Machine: {meta['machine']}; jax {meta['jax']}, optax {meta['optax']}; "
        f"load average before / after: {meta['load_before']} / {meta['load_after']}; "
        f"wall time {meta['wall_s']:.0f} s; {meta['rounds']} rounds x {meta['iters']} steps "
        f"per variant; allocators: {', '.join(meta['allocators'])}"
        + (f" (not installed: {', '.join(meta['missing'])})" if meta.get("missing") else "")
        + ".",
        "",
        "`x plain`: the median over rounds of (variant median / plain median in that round), "
        "with the range over rounds. `compile`: CPU seconds of trace + lower + compile (first "
        "allocator only). `temp`: `memory_analysis()` temporaries. `moved`: bytes a good step "
        "reads and writes, estimated from the HLO, per parameter. `faults`: minor page faults "
        "per step.",
    ]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    allocs = list(dict.fromkeys(r["allocator"] for r in rows))
    for case in cases:
        first = next(r for r in rows if r["case"] == case)
        lines += [
            "",
            f"## {case} ({first['params'] / 1e6:.1f}M params, {first['leaves']} leaves)",
            "",
        ]
        lines.append(
            "| variant | "
            + " | ".join(f"x plain, {a}" for a in allocs)
            + " | ms, "
            + allocs[0]
            + " | faults/step | compile s | temp MB | moved B/param"
            " | kernels | cond | copies | selects |"
        )
        lines.append("|---|" + "---:|" * (len(allocs) + 9))
        for name in dict.fromkeys(r["variant"] for r in rows if r["case"] == case):
            cells, base = [], None
            for a in allocs:
                r = next(
                    (
                        r
                        for r in rows
                        if r["case"] == case and r["variant"] == name and r["allocator"] == a
                    ),
                    None,
                )
                if r is None:
                    cells.append("")
                    continue
                base = base or r
                cells.append(
                    f"REFUSED: {r['refused']}"
                    if r["refused"]
                    else f"{r['ratio']:.2f} ({r['ratio_lo']:.2f}-{r['ratio_hi']:.2f})"
                )
            comp = base["compile_cpu_s"]
            ms = "" if base["refused"] else f"{base['median_ms']:.2f}"
            lines.append(
                f"| {name} | "
                + " | ".join(cells)
                + f" | {ms} | {base['faults_per_step']:.0f} | "
                + ("" if comp is None else f"{comp:.2f}")
                + f" | {mb(base['temp_bytes'])} | "
                f"{base['bytes_moved'] / base['params']:.1f} | {base['kernels']} | "
                f"{base['conditionals']} | {base['param_sized_copies']} | "
                f"{base['param_sized_selects']} |"
            )
    if thr:
        lines += ["", "## Throughput (steps dispatched back to back, one block at the end)", ""]
        lines += ["| case | variant | allocator | x plain | ms |", "|---|---|---|---:|---:|"]
        lines += [
            f"| {r['case']} | {r['variant']} | {r['allocator']} | "
            + (
                f"REFUSED: {r['refused']} | |"
                if r["refused"]
                else f"{r['ratio']:.2f} ({r['ratio_lo']:.2f}-{r['ratio_hi']:.2f}) | "
                f"{r['median_ms']:.2f} |"
            )
            for r in thr
        ]
    checks = targets(rows, allocs)
    if checks:
        lines += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]
        lines += [f"| {t} | {m} | {ok} |" for t, m, ok in checks]
    if meta.get("check_report"):
        lines += ["", "## The overflow check alone (ieee, float16 gradients)", ""]
        lines.append(check_table(meta["check_report"]))
    if meta.get("compile_report"):
        lines += ["", "## Where the compile time goes (CPU seconds, from scratch)", ""]
        lines.append(compile_table(meta["compile_report"]))
    return "\n".join(lines) + "\n"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- bench_step.py: {name} begin -->", f"<!-- bench_step.py: {name} end -->"


def replace_block(text: str, name: str, body: str) -> str | None:
    """``text`` with the block marked ``name`` holding ``body``; None where it has no such
    block."""
    begin, end = markers(name)
    if begin not in text or end not in text:
        return None
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return head + begin + "\n" + body + "\n" + end + tail


def headline(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The headline tables docs/performance.md quotes, from the same rows as results.md."""
    rows = latency(rows)
    cases = [c for c in HEADLINE if any(r["case"] == c for r in rows)]
    allocs = list(dict.fromkeys(r["allocator"] for r in rows))
    title = {"mlp_20m": "20M", "deep_300": "300 leaves"}
    lines = [
        f"Quoted from `benchmarks/results.md` (written by the same run): "
        f"`{meta['command'].strip()}`, {meta['machine']}, load average before / after "
        f"{meta['load_before']} / {meta['load_after']}, {meta['rounds']} rounds x "
        f"{meta['iters']} steps. Ratios to the plain step, median over rounds (range).",
    ]
    for a in allocs:
        lines += [
            "",
            f"Allocator `{a}`:",
            "",
            "| variant | "
            + " | ".join(
                f"{title.get(c.split('/')[0], c.split('/')[0])} {c.split('/')[-1]}" for c in cases
            )
            + " |",
            "|---|" + "---:|" * len(cases),
        ]
        for name in dict.fromkeys(r["variant"] for r in rows if r["case"] in cases):
            cells = []
            for c in cases:
                r = next(
                    (r for r in rows if (r["allocator"], r["case"], r["variant"]) == (a, c, name)),
                    None,
                )
                cells.append(
                    ""
                    if r is None
                    else "refused"
                    if r["refused"]
                    else f"{r['ratio']:.2f} ({r['ratio_lo']:.2f}-{r['ratio_hi']:.2f})"
                )
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets_block(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The target-by-target check docs/benchmarks.md quotes, from the same rows."""
    rows = latency(rows)
    allocs = list(dict.fromkeys(r["allocator"] for r in rows))
    checks = targets(rows, allocs)
    lines = [
        f"Quoted from `benchmarks/results.md` (written by the same run): "
        f"`{meta['command'].strip()}`, {meta['machine']}."
    ]
    if checks:
        lines += ["", "| target | measured | met |", "|---|---|---|"]
        lines += [f"| {t} | {m} | {ok} |" for t, m, ok in checks]
    return "\n".join(lines)


def check_table(report: list[dict[str, Any]] | None) -> str:
    if not report:
        return ""
    lines = [
        "| workload | formulation | median ms | x grouped | compile s | temp B/param "
        "| moved B/param | kernels |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report:
        lines.append(
            f"| {r['workload']} | {r['check']} | {r['median_ms']:.2f} | "
            f"{r['x_grouped']:.2f} | {r['compile_cpu_s']:.2f} | "
            f"{r['temp_bytes_per_param']:.2f} | {r['bytes_moved_per_param']:.1f} | "
            f"{r['kernels']} |"
        )
    return "\n".join(lines)


def compile_table(report: list[dict[str, Any]] | None) -> str:
    if not report:
        return ""
    lines = [
        f"| step ({report[0]['workload']}, post) | adds "
        f"| compile s, min of {len(report[0]['all_s'])} "
        "| x plain | all compiles, s |",
        "|---|---|---:|---:|---|",
    ]
    for r in report:
        every = ", ".join(f"{t:.2f}" for t in r["all_s"])
        lines.append(
            f"| {r['step']} | {r['adds']} | {r['compile_cpu_s']:.2f} | {r['x_plain']:.2f} "
            f"| {every} |"
        )
    return "\n".join(lines)


def update_docs(
    rows: list[dict[str, Any]], meta: dict[str, Any], path: Path | tuple[Path, ...] = DOC_PAGES
) -> list[str]:
    """Rewrites the marked blocks of docs/performance.md (the summary tables) and
    docs/benchmarks.md (targets, the check's formulations, compile time), wherever their
    markers are; returns the blocks rewritten."""
    done: list[str] = []
    for page in (path,) if isinstance(path, Path) else path:
        done += _update_page(rows, meta, page)
    return done


def _update_page(rows: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> list[str]:
    if not path.exists():
        return []
    text, done = path.read_text(), []
    blocks = {"headline": headline(rows, meta), "targets": targets_block(rows, meta)}
    if meta.get("check_report"):
        blocks["check"] = (
            f"Quoted from `benchmarks/results.md` (same run as above, {max(meta['rounds'], 5)} "
            "interleaved calls each):\n\n" + check_table(meta["check_report"])
        )
    if meta.get("compile_report"):
        blocks["compile"] = (
            "Quoted from `benchmarks/results.md` (same run as above):\n\n"
            + compile_table(meta["compile_report"])
        )
    for name, body in blocks.items():
        new = replace_block(text, name, body)
        if new is not None:
            text = new
            done.append(name)
    path.write_text(text)
    return done
