"""What the plain step's float16 backward pass loses to underflow, on a case's own batch.

The plain step differentiates the loss unscaled. Where a gradient's value is below float16's
smallest subnormal (2^-24, about 6e-8) it is exactly zero; with the loss scaled (the
benchmark's ``INIT_SCALE``) it is a number. ``lost_entries`` counts, leaf by leaf, the entries
zero in the plain step's gradient and not in the scaled one (the same weights and batch, one
compiled function: the scale is an argument, and a scale of 1 is the plain step's product
exactly). The rounding is IEEE's, so the count holds on any backend up to the order of the
sums. Why it matters for timing: a GPU computes faster on zeros (less power), so a plain step
whose backward pass is mostly zeros is not the cost floor of a step that trains.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .workloads import (
    INIT_SCALE,
    WORKLOADS,
    Case,
    build_case,
    lm_loss_of_logits,
    make_lm_forward,
    to16,
    value_and_grads,
)


def lost_entries(case: Case) -> dict[str, Any]:
    """Per leaf and in all: entries of the plain step's gradient that are zero where the
    gradient of the loss times ``INIT_SCALE`` is not; a full step's case only."""
    if case.kind != "full":
        raise ValueError("the underflow count needs a full step's case (a batch to differentiate)")

    @jax.jit
    def grads(params: Any, args: tuple, scale: jax.Array) -> Any:
        return value_and_grads(case.loss, params, *args, case.pattern, scale)[1]

    plain, scaled = (
        grads(case.params, case.args, jnp.float32(scale)) for scale in (1.0, INIT_SCALE)
    )
    leaves = []
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(plain), jax.tree_util.tree_leaves(scaled), strict=True
    ):
        a, b = np.asarray(a), np.asarray(b)
        leaves.append(
            {
                "leaf": jax.tree_util.keystr(path),
                "size": int(a.size),
                "lost": int(np.sum((a == 0) & (b != 0))),
                "zero_plain": int(np.sum(a == 0)),
                "zero_scaled": int(np.sum(b == 0)),
            }
        )
    size = sum(r["size"] for r in leaves)
    lost = sum(r["lost"] for r in leaves)
    return {
        "scale": INIT_SCALE,
        "size": size,
        "lost": lost,
        "fraction": lost / size,
        "leaves": leaves,
    }


def logits_lost(case: Case, sequences: int = 1) -> dict[str, Any]:
    """The language model's float16 logits' gradient on the first ``sequences`` of the batch,
    each token weighted as in the whole batch's mean (so each entry is the one the full step
    computes): entries zero without the scale, and with it. The logits' gradient is what the
    two largest matmuls of the backward pass (the tied embedding's) multiply."""
    spec = WORKLOADS[case.workload]
    if spec["kind"] != "lm" or case.kind != "full":
        raise ValueError("the logits' gradient needs a language model's full step")
    tokens, targets = case.args
    share = sequences / tokens.shape[0]
    logits = jax.jit(make_lm_forward(spec))(to16(case.params), tokens[:sequences])

    @jax.jit
    def grad(z: jax.Array, labels: jax.Array, scale: jax.Array) -> jax.Array:
        return jax.grad(lambda z: lm_loss_of_logits(z, labels) * share * scale)(z)

    plain, scaled = (
        np.asarray(grad(logits, targets[:sequences], jnp.float32(scale)))
        for scale in (1.0, INIT_SCALE)
    )
    return {
        "sequences": sequences,
        "size": int(plain.size),
        "zero_plain": int(np.sum(plain == 0)),
        "zero_scaled": int(np.sum(scaled == 0)),
    }


def report(cases: list[str], out: Path, log: Any, parameters: bool = True) -> list[dict[str, Any]]:
    """Of each case, ``lost_entries`` (where ``parameters``) and, for a language model,
    ``logits_lost``: logged, and into ``out/underflow.json``."""
    rows = []
    for name in cases:
        case = build_case(name)
        row: dict[str, Any] = {"case": name}
        if WORKLOADS[case.workload]["kind"] == "lm":
            row["logits"] = z = logits_lost(case)
            log(
                f"{name}: the logits' float16 gradient, one sequence: {z['zero_plain']:,} of "
                f"{z['size']:,} entries zero unscaled ({z['zero_plain'] / z['size']:.4%}), "
                f"{z['zero_scaled']:,} scaled by {INIT_SCALE:g}"
            )
        if parameters:
            row |= lost_entries(case)
            worst = max(row["leaves"], key=lambda r: r["lost"] / r["size"])
            log(
                f"{name}: {row['lost']:,} of {row['size']:,} gradient entries lost "
                f"({row['fraction']:.1%}); the most in {worst['leaf']}: "
                f"{worst['lost'] / worst['size']:.1%} of {worst['size']:,}"
            )
        rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"jax": jax.__version__, "backend": jax.default_backend()}
    (out / "underflow.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return rows
