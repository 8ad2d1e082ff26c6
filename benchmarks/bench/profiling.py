"""Where a step's time goes, kernel by kernel: ``--profile DIR``.

The timed runs say how much slower a variant's step is than plain; this says in which
kernels. For each case and variant, the step is compiled and warmed up as the timed run does
it, then ``steps`` steps are dispatched back to back inside ``jax.profiler.trace`` (a trace of
its own per variant, written as Perfetto JSON). The trace's events are summed per track and name on
the device's tracks (on a machine without one, the host's): how many, and how many
microseconds in all. ``DIR/kernels.json`` holds, per case and variant, each track's total per
step, the largest names' count and time per step, and the names plain lacks or spends less
on, with the difference: the first place to read when a whole step costs more.

``--gpu-results`` traces the post step the same way after timing it (``summarize_case`` on the
traces ``harness.run_case`` leaves): each variant's device time per step, beside the timed
ratios.
"""

from __future__ import annotations

import collections
import gzip
import json
from pathlib import Path
from typing import Any

import jax

from .harness import compile_variant, trace_steps
from .workloads import build_case

TOP = 40  # names kept per variant (the largest); the raw traces keep everything


def _device_events(trace: Any) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """The complete events (``ph == "X"``) of the device's processes (else of every one),
    each with its track: ``process / thread`` as the trace names them."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
    device = {pid for pid, name in processes.items() if "/device:" in name}
    where = "device" if device else "host"
    kept = []
    for e in events:
        if e.get("ph") == "X" and (not device or e.get("pid") in device):
            pid, tid = e.get("pid"), e.get("tid")
            kept.append((f"{processes.get(pid, pid)} / {threads.get((pid, tid), tid)}", e))
    return where, kept


def summarize(path: Path, steps: int) -> dict[str, Any]:
    """The Perfetto trace at ``path``, summed per track and per event name, per step.

    Tracks of one device overlap (a GPU's trace has a line of XLA modules, one of XLA ops
    and one per stream, each covering the same time): the totals are per track, and the
    headline ``us_per_step`` is the busiest track's.
    """
    with gzip.open(path, "rt") as f:
        where, events = _device_events(json.load(f))
    count: collections.Counter[tuple[str, str]] = collections.Counter()
    micros: collections.Counter[tuple[str, str]] = collections.Counter()
    tracks: collections.Counter[str] = collections.Counter()
    for track, e in events:
        count[track, e["name"]] += 1
        micros[track, e["name"]] += float(e.get("dur", 0.0))
        tracks[track] += float(e.get("dur", 0.0))
    top = sorted(micros, key=lambda k: -micros[k])
    return {
        "events": where,
        "us_per_step": max(tracks.values(), default=0.0) / steps,
        "tracks": {t: us / steps for t, us in tracks.most_common()},
        "names": [
            {"track": t, "name": n, "count": count[t, n] / steps, "us": micros[t, n] / steps}
            for t, n in top[:TOP]
        ],
        "_all_us": {f"{t} | {n}": micros[t, n] / steps for t, n in top},
    }


def more_than(plain: dict[str, float], mine: dict[str, float]) -> list[dict[str, Any]]:
    """The names ``mine`` spends more on than ``plain`` (or that plain lacks), by how much
    per step, the largest first (``TOP`` of them)."""
    more = {n: us - plain.get(n, 0.0) for n, us in mine.items()}
    ranked = sorted((n for n in more if more[n] > 0), key=lambda n: -more[n])
    return [{"track | name": n, "us": more[n]} for n in ranked[:TOP]]


def summarize_case(traces: dict[str, Path], steps: int) -> dict[str, Any]:
    """Per variant, the summary of its trace (``traces[variant]``, ``steps`` steps), and
    beside plain's: what it spends beyond plain (``more_than_plain``)."""
    result = {variant: summarize(path, steps) for variant, path in traces.items()}
    plain = result.get("plain", {}).get("_all_us", {})
    for variant, summary in result.items():
        mine = summary.pop("_all_us")
        if variant != "plain" and plain:
            summary["more_than_plain"] = more_than(plain, mine)
    return result


def profile_case(
    case: Any, name: str, variants: list[str], steps: int, out: Path
) -> dict[str, Any]:
    """Per variant of the built ``case`` (named ``name``): its kernels over ``steps`` steps."""
    traces = {}
    for variant in variants:
        run = compile_variant(variant, case, False, lambda m: None)
        folder = out / f"{name.replace('/', '_')}.{variant}"
        traces[variant] = trace_steps(run, case.args, steps, folder)
    return summarize_case(traces, steps)


def write(cases: dict[str, Any], steps: dict[str, int], out: Path) -> dict[str, Any]:
    """``out/kernels.json`` with ``cases`` (case -> variant -> summary) traced over ``steps``
    (case -> steps) added: what an earlier run into ``out`` wrote stays, but for the case and
    variant this one traced again. Returns the file's content."""
    path = out / "kernels.json"
    doc = json.loads(path.read_text()) if path.exists() else {"steps": {}, "cases": {}}
    doc.update(device=str(jax.devices()[0]), jax=jax.__version__)
    doc["steps"] = {**doc["steps"], **steps}
    for case, variants in cases.items():
        doc["cases"][case] = {**doc["cases"].get(case, {}), **variants}
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def profile(cases: list[str], variants: list[str], steps: int, out: Path) -> dict[str, Any]:
    """``profile_case`` for every case, into ``out/kernels.json`` (``write``); returns what
    this run traced, in the file's form."""
    out.mkdir(parents=True, exist_ok=True)
    traced = {c: profile_case(build_case(c), c, variants, steps, out) for c in cases}
    write(traced, {c: steps for c in cases}, out)
    return {"steps": {c: steps for c in cases}, "cases": traced}
