"""Two breakdowns that end results.md (``--check-report``; the default run makes both).

- ``check_report``: the overflow check alone, in each formulation of ``prototypes.CHECKS``,
  on the benchmark's gradients, timed interleaved.
- ``compile_report``: the compile time of the post step built up from the plain step one
  piece at a time (``skeletons``: a run-time unscale, a ``lax.cond``, the check as its
  predicate), then the library's steps and ``optax.apply_if_finite``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import lossscale_jax as lsj

from ._library import leaf_overflow_vector
from .harness import compile_step, copy_tree, rotations
from .hlo import hlo_stats
from .prototypes import CHECKS, check_formulation
from .variants import VARIANTS, variant_plain
from .workloads import F16, F32, INIT_SCALE, LR, WORKLOADS, init_params, make_loss

COMPILE_REPEATS = 3


def check_report(rounds: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """One row per workload and check formulation: median ms, x the library's, compile CPU s,
    temporaries and bytes moved per parameter, kernels."""
    rows = []
    for workload in ("mlp_20m", "deep_300"):
        params = init_params(WORKLOADS[workload], "in_out", np.random.default_rng(0))
        grads = jax.tree_util.tree_map(lambda p: p.astype(F16), params)
        n = sum(g.size for g in jax.tree_util.tree_leaves(grads))
        comp = {}
        for name in CHECKS:
            with check_formulation(name):
                compiled, cpu, _ = compile_step(
                    lambda g: lsj.check_overflow(g, "ieee"), (grads,), donate=()
                )
            compiled(grads).block_until_ready()
            stats = hlo_stats(compiled.as_text(), set())
            comp[name] = (compiled, cpu, stats, compiled.memory_analysis().temp_size_in_bytes)
        times: dict[str, list[float]] = {k: [] for k in comp}
        for order in rotations(list(comp), rounds):
            for name in order:
                t0 = time.perf_counter()
                comp[name][0](grads).block_until_ready()
                times[name].append(time.perf_counter() - t0)
        base = statistics.median(times["grouped"])
        for name, (_, cpu, stats, temp) in comp.items():
            med = statistics.median(times[name])
            rows.append(
                {
                    "workload": workload,
                    "check": name,
                    "median_ms": med * 1e3,
                    "x_grouped": med / base,
                    "compile_cpu_s": cpu,
                    "temp_bytes_per_param": temp / n,
                    "kernels": stats["kernels"],
                    "bytes_moved_per_param": stats["bytes_moved"] / n,
                }
            )
            log(
                f"  {workload:9s} {name:8s} {med * 1e3:8.2f} ms  x{med / base:5.2f}  "
                f"compile {cpu:5.2f} s  temp {temp / n:5.2f} B/param  kernels {stats['kernels']}"
            )
    return rows


def skeletons() -> dict[str, tuple[str, Callable, Callable]]:
    """Post steps from the plain one towards the library's, each adding one piece.

    ``name: (what it adds, step, init)``; a step is ``(params, state, grads) -> ...`` with
    float16 grads and float32 params. Past ``plain`` the state is ``(adam_state, scale)``: the
    scale is read at run time, as the library reads it.
    """
    adam = optax.adam(LR)

    def init(params):
        return adam.init(params), jnp.asarray(INIT_SCALE, F32)

    def unscaled(params, state, grads):
        adam_state, scale = state
        inv = 1.0 / scale
        grads = jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype) * inv, grads, params)
        updates, adam_state = adam.update(grads, adam_state, params)
        return optax.apply_updates(params, updates), (adam_state, scale)

    def keep(params, state, grads):
        return params, state

    def cond(params, state, grads):
        ok = jnp.isfinite(state[1])  # a predicate that reads no gradient
        return lax.cond(ok, unscaled, keep, params, state, grads)

    def check_cond(params, state, grads):
        flags = leaf_overflow_vector(grads)  # what loss_scaling checks and records
        ok = jnp.logical_not(jnp.any(flags))
        return (*lax.cond(ok, unscaled, keep, params, state, grads), flags)

    return {
        "plain": (
            "cast, Adam, apply (the baseline)",
            variant_plain(None, "fp16grad")[1],
            adam.init,
        ),
        "skel_unscale": ("+ unscale by a scale read at run time", unscaled, init),
        "skel_cond": ("+ lax.cond on a predicate that reads no gradient", cond, init),
        "skel_check_cond": (
            "+ the overflow check as the predicate, its per-leaf record",
            check_cond,
            init,
        ),
    }


def compile_report(workload: str, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Compile CPU seconds of the post step built up piece by piece, then the library's.

    Every step is compiled from scratch (``jax.clear_caches``) ``COMPILE_REPEATS`` times and
    the minimum is kept: compile times scatter by +-25% between identical compiles.
    """
    spec = WORKLOADS[workload]
    rng = np.random.default_rng(0)
    params = init_params(spec, "in_out", rng)
    grads = jax.tree_util.tree_map(lambda p: jnp.asarray(rng.normal(size=p.shape), F16), params)
    steps = skeletons()
    loss = make_loss(spec, "in_out")
    for name, what in (
        ("lsj_fused_ieee", "the library's fused step (policy, counters, record)"),
        ("lsj_optax_ieee", "the library's Optax path (tx.update, apply_updates)"),
        ("optax_if_finite", "optax.apply_if_finite (peer)"),
    ):
        _, post, init, _ = VARIANTS[name](loss, "fp16grad")
        steps[name] = (what, post, init)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(COMPILE_REPEATS):
        for name, (_, fn, init) in steps.items():
            args = (copy_tree(params), init(params), grads)
            times[name].append(compile_step(fn, args, fresh=True)[1])
    base = min(times["plain"])
    rows = []
    for name, (what, _, _) in steps.items():
        best = min(times[name])
        rows.append(
            {
                "workload": workload,
                "step": name,
                "adds": what,
                "compile_cpu_s": best,
                "all_s": times[name],
                "x_plain": best / base,
            }
        )
        log(f"  {workload:9s} {name:18s} compile {best:6.2f} s  x{best / base:5.2f}")
    return rows
