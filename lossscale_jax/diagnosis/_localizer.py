"""The localizer of ``diagnose``: per tap, where float16 leaves its range, in network order.

For a model with taps (Flax modules, ``lsj.tap`` calls, the loss through ``scale_loss``) each
batch is run three more times with the taps recording: the float16 forward and backward pass
(forward statistics: does the activation overflow in float16?), and the float32 reference at
scale 1 and at the recommended scale (how much of each activation gradient is zero or
subnormal in float16). Rows come in the order the forward pass met the taps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale_jax.engine import _tap_stats as layout
from lossscale_jax.engine._tap_stats import TapStats
from lossscale_jax.taps._tapping import Recorder, recorder


@dataclasses.dataclass(frozen=True)
class TapDiagnosis:
    """What float16 does at one tap (an activation and its gradient): one localizer row.

    Attributes:
      name: the tap (a module path, ``"loss"``, or an ``lsj.tap`` name).
      forward_max: the largest ``|activation|`` in the float16 forward pass (``inf``
        when it overflowed), over the batches.
      forward_max_reference: the same in the float32 reference.
      forward_overflows: whether the float16 activation leaves float16's range (an
        inf or nan there, or a reference value at or above 65504).
      backward_max: the largest ``|gradient|`` arriving at the tap in the float32
        reference at scale 1.
      underflow_unscaled: the fraction of its nonzero reference gradient entries
        below 2**-14 (zero or subnormal in float16) at scale 1.
      underflow_at_recommended: the same at the recommended scale (``nan`` when
        there is none).
    """

    name: str
    forward_max: float
    forward_max_reference: float
    forward_overflows: bool
    backward_max: float
    underflow_unscaled: float
    underflow_at_recommended: float


def stats_fn(fn: Callable[[Any, Any], jax.Array], sinks: TapStats, select: Any) -> Callable:
    """``jit``-ed ``(params, batch, scale) -> TapStats`` of ``fn(params, batch) * scale``."""

    def scaled(values: Any, params: Any, batch: Any, scale: jax.Array) -> jax.Array:
        stats = TapStats(sinks.names, sinks.dtypes, values)
        with recorder(Recorder(sinks=stats, forward=True), select, None):
            loss = fn(params, batch)
        return jnp.asarray(loss).astype(jnp.float32) * scale

    grad = jax.grad(scaled)

    @jax.jit
    def run(params: Any, batch: Any, scale: jax.Array) -> Any:
        return jnp.stack(grad(list(sinks.values), params, batch, scale))

    return run


def rows(
    names: tuple[str, ...],
    low: list[np.ndarray],
    reference: list[np.ndarray],
    reference_at: list[np.ndarray] | None,
    threshold: float,
) -> tuple[TapDiagnosis, ...]:
    """One row per tap from the per-batch ``[taps, WIDTH]`` statistics."""

    def total(runs: list[np.ndarray]) -> np.ndarray:
        return np.sum(runs, axis=0)

    def peak(runs: list[np.ndarray], index: int) -> np.ndarray:
        return np.max(np.stack(runs)[..., index], axis=0)

    def fraction(runs: list[np.ndarray]) -> np.ndarray:
        t = total(runs)
        return t[:, layout.UNDERFLOW] / np.maximum(t[:, layout.NONZERO], 1.0)

    fwd_low = peak(low, layout.FWD_MAX)
    fwd_bad = total(low)[:, layout.FWD_NONFINITE] > 0
    fwd_ref = peak(reference, layout.FWD_MAX)
    under_at = fraction(reference_at) if reference_at is not None else None
    out = []
    for i, name in enumerate(names):
        out.append(
            TapDiagnosis(
                name=name,
                forward_max=float("inf") if fwd_bad[i] else float(fwd_low[i]),
                forward_max_reference=float(fwd_ref[i]),
                forward_overflows=bool(fwd_bad[i] or fwd_ref[i] >= threshold),
                backward_max=float(peak(reference, layout.MAX)[i]),
                underflow_unscaled=float(fraction(reference)[i]),
                underflow_at_recommended=float("nan") if under_at is None else float(under_at[i]),
            )
        )
    return tuple(out)


def first_overflow(taps: tuple[TapDiagnosis, ...]) -> TapDiagnosis | None:
    """The first tap (forward order) whose float16 activation leaves the range."""
    return next((t for t in taps if t.forward_overflows), None)


def underflow_start(taps: tuple[TapDiagnosis, ...], tolerance: float) -> TapDiagnosis | None:
    """Walking the backward pass from the loss: the first tap whose gradient underflows
    (more than ``tolerance`` of its entries below 2**-14 at scale 1)."""
    return next((t for t in reversed(taps) if t.underflow_unscaled > tolerance), None)


def table(taps: tuple[TapDiagnosis, ...], recommended: str) -> list[str]:
    """The localizer's lines of ``Diagnosis.table``."""
    if not taps:
        return []
    head = ["tap (forward order)", "fwd max f16", "fwd max f32", "", "bwd max", "under@1"]
    head.append(f"under@{recommended}")
    body = [
        [
            t.name,
            f"{t.forward_max:.2e}",
            f"{t.forward_max_reference:.2e}",
            "OVERFLOWS" if t.forward_overflows else "",
            f"{t.backward_max:.2e}",
            pct(t.underflow_unscaled),
            "-" if np.isnan(t.underflow_at_recommended) else pct(t.underflow_at_recommended),
        ]
        for t in taps
    ]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in (0, 3) else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return [
        "",
        "activations and their gradients, per tap (float32 reference unless marked f16):",
        line(head),
        line(["-" * w for w in widths]),
        *[line(r) for r in body],
    ]


def pct(x: float) -> str:
    """A fraction as the diagnosis tables write it: "0", "<0.01%" or "12.34%"."""
    if x == 0:
        return "0"
    if x < 1e-4:
        return "<0.01%"
    return f"{100 * x:.2f}%"


def verdict(
    base: str,
    loss_finite: bool,
    taps: tuple[TapDiagnosis, ...],
    tolerance: float,
    scaling_needed: bool = True,
) -> str:
    """The model's verdict with the localizer's findings: the first module whose float16
    forward output leaves the range (instead of "the layers"), and, when a scale is
    needed, where the backward gradients start to underflow."""
    hot = first_overflow(taps)
    if hot is not None:
        where = (
            f"the float16 forward pass overflows first at {hot.name} (max |activation| "
            f"{hot.forward_max_reference:.3g} in float32, float16 ends at 65504)"
        )
        if not loss_finite:
            base = (
                f"the float16 loss is not finite: {where}, which no loss scale fixes: "
                f"keep {hot.name} in float32"
            )
        else:
            base = f"{base}; {where}: keep {hot.name} in float32"
    cold = underflow_start(taps, tolerance) if scaling_needed else None
    if cold is not None:
        base += (
            f"; the backward gradients start to underflow at {cold.name} "
            f"({pct(cold.underflow_unscaled)} of its entries below 2^-14 without scaling)"
        )
    return base
