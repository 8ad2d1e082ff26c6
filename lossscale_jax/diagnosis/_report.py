"""The result of ``diagnose``: per-leaf rows, the model's verdict, the table and the picture."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from lossscale_jax.diagnosis._localizer import TapDiagnosis, pct
from lossscale_jax.diagnosis._localizer import table as localizer_table

# Histogram bins of floor(log2|g|): every finite nonzero float32 (2^-149 .. 2^127).
# A reference entry counts as nonzero when |g| > NOISE * max|g| of its leaf (per batch):
# smaller ones are at the rounding noise of the float32 computation (the gradient of
# attention's key bias, which softmax cannot see, is 0 in exact arithmetic and about
# 1e-16, 2^-40 of its leaf's largest, in float32), not gradient float16 could lose.
NOISE = float(np.finfo(np.float32).eps)
LOG2_MIN, LOG2_MAX = -150, 128
_N_BINS = LOG2_MAX - LOG2_MIN + 1

NO_SCALING = "float16 needs no scaling here"
SCALE_NEEDED = "scale needed"
OVERFLOWS = "this layer overflows at any scale: keep it in float32"
UNDERFLOWS = "underflows at every safe scale: keep it in float32"


@dataclasses.dataclass(frozen=True)
class LeafDiagnosis:
    """What float16 does to one gradient leaf (one row of the table).

    Fractions of underflow count the entries that are nonzero in the float32
    reference gradient and exactly zero in the float16 one (nonzero: above the
    reference's rounding noise, ``|g| > eps(float32) * max|g|`` of the leaf;
    e.g. attention's key bias, whose gradient is 0 in exact arithmetic, is
    left out); fractions of
    overflow count entries that are inf, nan or ``|g| >= 65504`` in the
    float16 gradient (of the scaled loss), over all entries. Both are over
    every batch given to ``diagnose``.

    Attributes:
      path: the leaf's key path (``jax.tree_util.keystr``).
      shape: the leaf's shape.
      max_abs: the largest ``|g|`` of the float32 reference gradient.
      min_abs: the smallest nonzero ``|g|`` of the reference (``nan`` if all are 0).
      underflow: per scale of ``Diagnosis.scales``, the fraction that underflows.
      overflow: per scale of ``Diagnosis.scales``, the fraction that overflows.
      underflow_unscaled: ``underflow`` at scale 1 (float16 without loss scaling).
      underflow_at_scale: ``underflow`` at the scale in use (``Diagnosis.scale``).
      overflow_at_scale: ``overflow`` at the scale in use.
      log2_histogram: counts of the reference's nonzero entries by
        ``floor(log2|g|)``, bin ``i`` for exponent ``LOG2_MIN + i``.
      verdict: ``"float16 needs no scaling here"``, ``"scale needed"``,
        ``"underflows at every safe scale: keep it in float32"`` or ``"this
        layer overflows at any scale: keep it in float32"``.
      subnormal: per scale, the fraction of the nonzero entries that are deep
        in float16's subnormals (nonzero, below 2**-17: 8 significant bits or
        fewer kept, fewer than bfloat16 keeps; a relative error above 2**-9).
      subnormal_unscaled: ``subnormal`` at scale 1.
      subnormal_at_scale: ``subnormal`` at the scale in use.

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale_jax as lsj
      >>> def loss_fn(params, x):               # float16 compute, loss weight in float32
      ...     y = x @ params["w"].astype(jnp.float16)
      ...     return jnp.sum(y.astype(jnp.float32)) * 1e-8
      >>> report = lsj.diagnose(loss_fn, {"w": jnp.ones((2, 2))},
      ...                       [jnp.ones((1, 2), jnp.float16)], print_table=False)
      >>> leaf = report.leaves[0]
      >>> leaf.path, leaf.underflow_unscaled, leaf.verdict    # 1e-8 is below float16
      ("['w']", 1.0, 'scale needed')
    """

    path: str
    shape: tuple[int, ...]
    max_abs: float
    min_abs: float
    underflow: np.ndarray
    overflow: np.ndarray
    underflow_unscaled: float
    underflow_at_scale: float
    overflow_at_scale: float
    log2_histogram: np.ndarray
    verdict: str
    subnormal: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    subnormal_unscaled: float = 0.0
    subnormal_at_scale: float = 0.0


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """What float16 does to a model's gradients: the result of ``diagnose``.

    Attributes:
      leaves: one ``LeafDiagnosis`` per floating leaf of ``params``.
      scales: the loss scales tried (ascending; 1 and the scale in use included).
      scale: the scale in use (``diagnose``'s ``scale``).
      underflow: per scale, the fraction of the model's nonzero reference
        entries that underflow to zero in float16.
      overflow: per scale, the fraction of the model's entries that overflow.
      init_scale_range: ``(lowest, highest)``: the largest scale with no
        overflow (all smaller scales tried overflow-free too) and the smallest
        whose loss (entries underflowing to zero plus entries left subnormal)
        is within ``tolerance`` of the least any overflow-free scale reaches;
        ``None`` when every scale overflows.
      recommended_scale: the power of two in the middle of
        ``init_scale_range`` (in log2), headroom both ways; ``None`` when there
        is no range.
      underflow_floor: the least underflow fraction of an overflow-free scale.
      loss_finite: whether the float16 loss was finite on every batch (if not,
        the forward pass overflows and no loss scale helps).
      verdict: for the model: ``"float16 needs no scaling here"``, ``"scale
        needed: ..."``, or what overflows.
      num_batches: how many batches were used.
      tolerance: the underflow (fraction) above the floor still counted as
        at the floor.
      taps: the localizer's rows, one ``TapDiagnosis`` per tap of the model (Flax
        modules, ``lsj.tap`` calls, the loss through ``scale_loss``) in forward
        order; empty for a model without taps.
      subnormal: per scale, the fraction of the model's nonzero reference
        entries deep in float16's subnormals (nonzero, below 2**-17: 8 significant
        bits or fewer).

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale_jax as lsj
      >>> def loss_fn(params, x):                  # float32 weights, float16 compute
      ...     y = x @ params["w"].astype(jnp.float16)
      ...     return jnp.mean(y.astype(jnp.float32) ** 2) * 1e-7
      >>> report = lsj.diagnose(loss_fn, {"w": jnp.ones((4, 2)) * 0.1},
      ...                       [jnp.ones((8, 4), jnp.float16)], print_table=False)
      >>> report.verdict.split(":")[0], report.recommended_scale >= 2.0**8
      ('scale needed', True)
    """

    leaves: tuple[LeafDiagnosis, ...]
    scales: np.ndarray
    scale: float
    underflow: np.ndarray
    overflow: np.ndarray
    init_scale_range: tuple[float, float] | None
    recommended_scale: float | None
    underflow_floor: float
    loss_finite: bool
    verdict: str
    num_batches: int
    tolerance: float
    taps: tuple[TapDiagnosis, ...] = ()
    subnormal: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))

    def table(self) -> str:
        """The diagnosis as a text table: one row per leaf, then the model's verdict.

        Columns: the leaf, its largest and smallest nonzero ``|g|`` (float32
        reference), the fraction of its entries that underflow to zero in
        float16 (``zero@1``, without scaling) and that are left deep in its
        subnormals (``subnormal@1``: below 2**-17, 8 significant bits or fewer), the same at the
        scale in use, the fraction that overflows at the scale in use, and the
        verdict.

        Returns:
          The table, ready to print.

        Examples:
          >>> import jax.numpy as jnp
          >>> import lossscale_jax as lsj
          >>> report = lsj.diagnose(lambda p, x: jnp.sum(x @ p["w"].astype(jnp.float16)),
          ...                       {"w": jnp.ones((2, 2))}, [jnp.ones((1, 2))],
          ...                       print_table=False)
          >>> print(report.table().splitlines()[-1])
          model: float16 needs no scaling here
        """
        at = _fmt_scale(self.scale)
        head = ["leaf", "shape", "max|g|", "min|g|>0", "zero@1", "subnormal@1"]
        head += [f"zero@{at}", f"subnormal@{at}", f"overflow@{at}", "verdict"]
        rows = [
            [
                leaf.path,
                "x".join(map(str, leaf.shape)) or "()",
                f"{leaf.max_abs:.2e}",
                f"{leaf.min_abs:.2e}",
                pct(leaf.underflow_unscaled),
                pct(leaf.subnormal_unscaled),
                pct(leaf.underflow_at_scale),
                pct(leaf.subnormal_at_scale),
                pct(leaf.overflow_at_scale),
                leaf.verdict,
            ]
            for leaf in self.leaves
        ]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        right = {2, 3, 4, 5, 6, 7, 8}

        def line(cells: list[str]) -> str:
            return "  ".join(
                c.rjust(w) if i in right else c.ljust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()

        i1 = int(np.searchsorted(self.scales, 1.0))
        out = [
            f"float16 gradients of {len(self.leaves)} leaves over {self.num_batches} "
            f"batch(es), against a float32 reference; scale in use {at}",
            line(head),
            line(["-" * w for w in widths]),
            *[line(r) for r in rows],
            "",
            f"model: without scaling {pct(self.underflow[i1])} zero and "
            f"{pct(self.subnormal[i1])} subnormal (floor {pct(self.underflow_floor)} zero);",
            f"at {at}: {pct(_at(self, self.underflow))} zero, "
            f"{pct(_at(self, self.subnormal))} subnormal, "
            f"overflow {pct(_at(self, self.overflow))}",
            "(zero: the entry is lost; subnormal: below 2^-17, kept with 8 significant bits "
            "or fewer)",
        ]
        if self.init_scale_range is not None:
            lo, hi = self.init_scale_range
            top = " (the largest scale tried)" if hi >= self.scales[-1] else ""
            out.append(
                f"init_scale range [{_fmt_scale(lo)}, {_fmt_scale(hi)}{top}], "
                f"recommended {_fmt_scale(self.recommended_scale)}"
            )
        out.extend(localizer_table(self.taps, _fmt_scale(self.recommended_scale)))
        out.append(f"model: {self.verdict}")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path: str | os.PathLike[str] | None = None, *, max_leaves: int = 40) -> Any:
        """The distribution of log2|g| against float16's range (needs matplotlib).

        Two panels: the whole model's histogram of ``log2|g|`` (float32
        reference, gray) and the same shifted by the recommended scale
        (``log2 S`` to the right, outlined), over float16's regions: values
        that flush to zero (below 2^-24), subnormals (2^-24 to 2^-14), the
        normal range, and the 65504 ceiling; then, per leaf, the range of
        ``log2|g|`` (thin: min to max; thick: 5th to 95th percentile) unscaled
        and shifted. matplotlib is imported here only (``pip install
        'lossscale_jax[plot]'``).

        Args:
          path: where to save the figure (PNG, SVG, ... by extension); not
            saved when ``None``.
          max_leaves: the most leaves the second panel draws (the first
            ``max_leaves`` in leaf order).

        Returns:
          The ``matplotlib.figure.Figure``.

        Raises:
          ImportError: if matplotlib is not installed.

        Examples:
          >>> import os, tempfile, jax.numpy as jnp
          >>> import lossscale_jax as lsj
          >>> report = lsj.diagnose(lambda p, x: jnp.sum(x @ p["w"].astype(jnp.float16)),
          ...                       {"w": jnp.ones((2, 2))}, [jnp.ones((1, 2))],
          ...                       print_table=False)
          >>> path = os.path.join(tempfile.mkdtemp(), "float16.png")
          >>> fig = report.plot(path)
          >>> os.path.exists(path)
          True
        """
        from lossscale_jax.diagnosis import _plot

        return _plot.plot(self, path, max_leaves=max_leaves, log2_min=LOG2_MIN)


def _fmt_scale(s: float | None) -> str:
    if s is None:
        return "-"
    e = math.log2(s)
    return f"2^{int(e)}" if e == int(e) else f"{s:g}"


def _at(d: Diagnosis, values: np.ndarray) -> float:
    return float(values[int(np.searchsorted(d.scales, d.scale))])


def summarize(paths, shapes, results, grid, scale, tolerance, print_table) -> Diagnosis:
    loss_finite = all(bool(np.isfinite(r[1])) for r in results)
    max_abs = np.max([r[2] for r in results], axis=0)
    min_abs = np.min([r[3] for r in results], axis=0)
    nonzero = np.sum([r[4] for r in results], axis=0).astype(np.int64)
    hist = np.sum([r[5] for r in results], axis=0).astype(np.int64)
    under = np.sum([r[6] for r in results], axis=0).astype(np.int64)  # [scales, leaves]
    over = np.sum([r[7] for r in results], axis=0).astype(np.int64)
    sub = np.sum([r[8] for r in results], axis=0).astype(np.int64)
    sizes = np.asarray([math.prod(s) for s in shapes], np.int64) * len(results)

    leaf_under = under / np.maximum(nonzero, 1)
    leaf_over = over / np.maximum(sizes, 1)
    model_under = under.sum(axis=1) / max(int(nonzero.sum()), 1)
    model_over = over.sum(axis=1) / max(int(sizes.sum()), 1)
    leaf_sub = sub / np.maximum(nonzero, 1)
    model_sub = sub.sum(axis=1) / max(int(nonzero.sum()), 1)
    # Zeros lose an entry, subnormals keep it with fewer significant bits: the range's lower
    # end is where the entries that matter are normal floats.
    model_lost = model_under + model_sub
    leaf_lost = leaf_under + leaf_sub

    safe = np.cumprod(model_over == 0).astype(bool)  # no overflow here nor at any smaller scale
    i1 = int(np.searchsorted(grid, 1.0))
    i_scale = int(np.searchsorted(grid, scale))
    if safe.any():
        top = int(np.nonzero(safe)[0][-1])
        floor = float(model_under[: top + 1].min())
        lost_floor = float(model_lost[: top + 1].min())
        bottom = int(np.nonzero(model_lost[: top + 1] <= lost_floor + tolerance)[0][0])
        scale_range = (float(grid[bottom]), float(grid[top]))
        mid = round((math.log2(scale_range[0]) + math.log2(scale_range[1])) / 2)
        recommended = float(min(max(2.0**mid, scale_range[0]), scale_range[1]))
    else:
        top, floor, scale_range, recommended = None, float(model_under.min()), None, None
        lost_floor = float(model_lost.min())

    leaves = []
    for j, path in enumerate(paths):
        every = bool(np.all(leaf_over[:, j] > 0))
        if every:
            verdict = OVERFLOWS
        elif top is not None and leaf_lost[top, j] > tolerance:
            verdict = UNDERFLOWS
        elif leaf_lost[i1, j] <= (leaf_lost[top, j] if top is not None else 0) + tolerance and (
            leaf_over[i1, j] == 0
        ):
            verdict = NO_SCALING
        else:
            verdict = SCALE_NEEDED
        leaves.append(
            LeafDiagnosis(
                path=path,
                shape=shapes[j],
                max_abs=float(max_abs[j]),
                min_abs=float(min_abs[j]) if nonzero[j] else float("nan"),
                underflow=leaf_under[:, j].copy(),
                overflow=leaf_over[:, j].copy(),
                underflow_unscaled=float(leaf_under[i1, j]),
                underflow_at_scale=float(leaf_under[i_scale, j]),
                overflow_at_scale=float(leaf_over[i_scale, j]),
                log2_histogram=hist[j].copy(),
                verdict=verdict,
                subnormal=leaf_sub[:, j].copy(),
                subnormal_unscaled=float(leaf_sub[i1, j]),
                subnormal_at_scale=float(leaf_sub[i_scale, j]),
            )
        )

    if not loss_finite:
        verdict = (
            "the float16 loss is not finite: the forward pass overflows, which no loss scale "
            "fixes; keep the layers whose activations exceed 65504 in float32"
        )
    elif scale_range is None:
        names = [leaf.path for leaf in leaves if leaf.verdict == OVERFLOWS] or ["(the model)"]
        verdict = f"overflows at every scale tried: keep {', '.join(names)} in float32"
    elif model_lost[i1] <= lost_floor + tolerance and safe[i1]:
        verdict = NO_SCALING
    else:
        lo, hi = scale_range
        verdict = (
            f"{SCALE_NEEDED}: init_scale in [{_fmt_scale(lo)}, {_fmt_scale(hi)}], "
            f"e.g. {_fmt_scale(recommended)}"
        )
        keep = [leaf.path for leaf in leaves if leaf.verdict in (OVERFLOWS, UNDERFLOWS)]
        if keep:
            verdict += f"; keep {', '.join(keep)} in float32"
    diagnosis = Diagnosis(
        leaves=tuple(leaves),
        scales=grid,
        scale=scale,
        underflow=model_under,
        overflow=model_over,
        init_scale_range=scale_range,
        recommended_scale=recommended,
        underflow_floor=floor,
        loss_finite=loss_finite,
        verdict=verdict,
        num_batches=len(results),
        tolerance=tolerance,
        subnormal=model_sub,
    )
    if print_table:
        print(diagnosis.table())
    return diagnosis
