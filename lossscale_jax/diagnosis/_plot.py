"""The picture of a ``Diagnosis``: log2|g| against float16's range (matplotlib, optional)."""

from __future__ import annotations

import math
import os
import re
import textwrap
from typing import Any

import numpy as np

# float16: smallest subnormal 2^-24, smallest normal 2^-14, largest finite 65504.
_SUBNORMAL, _NORMAL, _CEILING = -24.0, -14.0, math.log2(65504.0)
# Characters per line of a panel's title: longer titles wrap rather than run off the figure.
_TITLE_WIDTH = 100


def _short(path: str) -> str:
    """``['params']['Dense_0']['kernel']`` -> ``params/Dense_0/kernel``."""
    parts = re.findall(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)", path)
    names = [a or b or c for a, b, c in parts]
    return "/".join(names) if names else path


def _percentile(hist: np.ndarray, q: float, offset: int) -> float:
    total = hist.sum()
    if total == 0:
        return float("nan")
    k = int(np.searchsorted(np.cumsum(hist), q * total))
    return float(min(k, hist.size - 1) + offset)


def _regions(ax: Any, lo: float, hi: float, legend: bool) -> None:
    ax.axvspan(lo, _SUBNORMAL, color="#d62728", alpha=0.10, lw=0, label="flushes to 0 in float16")
    ax.axvspan(_SUBNORMAL, _NORMAL, color="#ff7f0e", alpha=0.12, lw=0, label="float16 subnormal")
    ax.axvspan(_NORMAL, _CEILING, color="#2ca02c", alpha=0.06, lw=0, label="float16 normal range")
    ax.axvspan(_CEILING, hi, color="#d62728", alpha=0.18, lw=0, label="overflows (> 65504)")
    ax.axvline(_CEILING, color="#d62728", lw=1.2)
    if legend:
        ax.text(
            _CEILING, 1.0, " 65504", color="#d62728", va="top", transform=ax.get_xaxis_transform()
        )


def plot(
    diagnosis: Any, path: str | os.PathLike | None, *, max_leaves: int = 40, log2_min: int
) -> Any:
    """The figure of ``Diagnosis.plot``; ``log2_min`` is the exponent of the first histogram bin."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "Diagnosis.plot needs matplotlib, an optional dependency: "
            "pip install 'lossscale_jax[plot]' (or pip install matplotlib)."
        ) from e
    leaves = diagnosis.leaves
    shift_scale = diagnosis.recommended_scale or diagnosis.scale
    shift = math.log2(shift_scale)
    hist = np.sum([leaf.log2_histogram for leaf in leaves], axis=0)
    used = np.nonzero(hist)[0]
    data_lo = float(used[0] + log2_min) if used.size else -30.0
    data_hi = float(used[-1] + log2_min + 1) if used.size else 0.0
    lo = min(data_lo, -30.0) - 2
    hi = max(data_hi + shift, 20.0) + 2
    for t in diagnosis.taps:  # room for the activations' maxima
        if math.isfinite(_log2(t.forward_max_reference)):
            hi = max(hi, _log2(t.forward_max_reference) + 2)

    drawn = leaves[:max_leaves]
    taps = tuple(diagnosis.taps)[:max_leaves]
    heights = [3.0, 0.6 + 0.3 * len(drawn)] + ([0.6 + 0.3 * len(taps)] if taps else [])
    fig = Figure(figsize=(9.0, 0.6 + sum(heights)), layout="constrained")
    axes = fig.subplots(len(heights), 1, sharex=True, gridspec_kw={"height_ratios": heights})
    top, bottom = axes[0], axes[1]

    # The whole model: fraction of nonzero entries per binade, unscaled and shifted.
    x = np.arange(hist.size) + log2_min
    frac = hist / max(hist.sum(), 1)
    _regions(top, lo, hi, legend=True)
    top.bar(x, frac, width=1.0, align="edge", color="0.45", label="|g| (float32 reference)")
    top.stairs(
        frac,
        np.append(x, x[-1] + 1) + shift,
        color="#1f77b4",
        lw=1.8,
        label=f"|g| x {_scale_label(shift_scale)} (loss scale)",
    )
    top.set_xlim(lo, hi)
    top.set_ylabel("fraction of entries")
    verdict = textwrap.fill(f"model: {diagnosis.verdict}", 95)
    top.set_title(f"Gradients against float16's range\n{verdict}", fontsize=10, loc="left")
    # Below the panels, not over the histogram: a legend inside would cover data.
    fig.legend(*top.get_legend_handles_labels(), fontsize=8, loc="outside lower center", ncols=3)

    # Per leaf: min..max (thin) and 5th..95th percentile (thick), unscaled and shifted.
    _regions(bottom, lo, hi, legend=False)
    for row, leaf in enumerate(drawn):
        h = leaf.log2_histogram
        nz = np.nonzero(h)[0]
        if nz.size == 0:
            continue
        mn, mx = nz[0] + log2_min, nz[-1] + log2_min + 1
        p5, p95 = _percentile(h, 0.05, log2_min), _percentile(h, 0.95, log2_min) + 1
        y = len(drawn) - 1 - row
        for dx, color, dy in ((0.0, "0.35", 0.14), (shift, "#1f77b4", -0.14)):
            bottom.plot([mn + dx, mx + dx], [y + dy] * 2, color=color, lw=1.0)
            bottom.plot(
                [p5 + dx, p95 + dx], [y + dy] * 2, color=color, lw=4.0, solid_capstyle="butt"
            )
    bottom.set_yticks(
        range(len(drawn)), [_short(leaf.path) for leaf in reversed(drawn)], fontsize=8
    )
    bottom.set_ylim(-0.7, len(drawn) - 0.3)
    bottom.set_xlabel("log2 |g|" if not taps else "")
    more = f" (first {len(drawn)} of {len(leaves)})" if len(drawn) < len(leaves) else ""
    bottom.set_title(
        textwrap.fill(
            f"per leaf{more}: gray unscaled, blue x {_scale_label(shift_scale)}; "
            "thin min-max, thick 5-95%",
            _TITLE_WIDTH,
        ),
        fontsize=9,
        loc="left",
    )
    if taps:
        _activations(axes[2], taps, shift, shift_scale, lo, hi)
    if path is not None:
        fig.savefig(os.fspath(path), dpi=110)
    return fig


def _log2(x: float) -> float:
    return math.log2(x) if x > 0 and math.isfinite(x) else float("nan")


def _activations(ax: Any, taps: tuple, shift: float, shift_scale: float, lo: float, hi: float):
    """Per tap in network order (top to bottom): the forward activation's max (orange, a red
    cross where float16 overflows) and the backward gradient's max, unscaled (gray) and
    scaled (blue), with the share below 2^-14 at each."""
    _regions(ax, lo, hi, legend=False)
    n = len(taps)
    for row, t in enumerate(taps):
        y = n - 1 - row
        fwd = min(_log2(t.forward_max_reference), hi - 0.5)
        ax.plot(
            fwd,
            y + 0.18,
            marker="x" if t.forward_overflows else ">",
            ms=7,
            color="#d62728" if t.forward_overflows else "#ff7f0e",
        )
        bwd = _log2(t.backward_max)
        ax.plot(bwd, y - 0.14, marker="o", ms=5, color="0.35")
        ax.plot(bwd + shift, y - 0.14, marker="o", ms=5, color="#1f77b4")
        if math.isfinite(bwd):
            under = f"{100 * t.underflow_unscaled:.0f}%"
            if math.isfinite(t.underflow_at_recommended):
                under += f" -> {100 * t.underflow_at_recommended:.0f}%"
            ax.text(bwd + shift + 0.6, y - 0.14, under, fontsize=7, va="center")
    ax.set_yticks(range(n), [_short(t.name) for t in reversed(taps)], fontsize=8)
    ax.set_ylim(-0.7, n - 0.3)
    ax.set_xlabel("log2 |x| (activations) and log2 |g| (their gradients)")
    ax.set_title(
        textwrap.fill(
            "activations in network order: max (orange; red x: leaves float16); their "
            f"gradients' max unscaled (gray), x {_scale_label(shift_scale)} (blue), "
            "% below 2^-14",
            _TITLE_WIDTH,
        ),
        fontsize=9,
        loc="left",
    )


def _scale_label(s: float) -> str:
    e = math.log2(s)
    return f"2^{int(e)}" if e == int(e) else f"{s:g}"
