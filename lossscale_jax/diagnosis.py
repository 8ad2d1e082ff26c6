"""What float16 does to a model's gradients, leaf by leaf, and which loss scale fixes it.

``diagnose(loss_fn, params, batches)`` differentiates the loss twice per batch: in float32
(the reference) and in float16 at a range of loss scales, the way a training step does, and
reports per gradient leaf what float16 loses (entries that underflow to zero, entries that
overflow) with a verdict per leaf and for the model, and the range of initial scales that
neither overflows nor loses more than the least underflow any scale can reach. A host-side
tool, run before training (it is not part of a step); its computation is jitted.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale_jax import _upcast, numerics

__all__ = ["Diagnosis", "LeafDiagnosis", "diagnose"]

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
        whose underflow is within ``tolerance`` of the least any overflow-free
        scale reaches (its floor); ``None`` when every scale overflows.
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

    def table(self) -> str:
        """The diagnosis as a text table: one row per leaf, then the model's verdict.

        Columns: the leaf, its largest and smallest nonzero ``|g|`` (float32
        reference), the fraction of its entries that underflow to zero in
        float16 without scaling (``underflow@1``) and at the scale in use,
        the fraction that overflows at the scale in use, and the verdict.

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
        head = ["leaf", "shape", "max|g|", "min|g|>0", "underflow@1", f"underflow@{at}"]
        head += [f"overflow@{at}", "verdict"]
        rows = [
            [
                leaf.path,
                "x".join(map(str, leaf.shape)) or "()",
                f"{leaf.max_abs:.2e}",
                f"{leaf.min_abs:.2e}",
                _pct(leaf.underflow_unscaled),
                _pct(leaf.underflow_at_scale),
                _pct(leaf.overflow_at_scale),
                leaf.verdict,
            ]
            for leaf in self.leaves
        ]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        right = {2, 3, 4, 5, 6}

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
            f"model: underflow {_pct(self.underflow[i1])} without scaling, "
            f"floor {_pct(self.underflow_floor)}; at {at}: underflow "
            f"{_pct(_at(self, self.underflow))}, overflow {_pct(_at(self, self.overflow))}",
        ]
        if self.init_scale_range is not None:
            lo, hi = self.init_scale_range
            top = " (the largest scale tried)" if hi >= self.scales[-1] else ""
            out.append(
                f"init_scale range [{_fmt_scale(lo)}, {_fmt_scale(hi)}{top}], "
                f"recommended {_fmt_scale(self.recommended_scale)}"
            )
        out.append(f"model: {self.verdict}")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path: str | os.PathLike | None = None, *, max_leaves: int = 40) -> Any:
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
        from lossscale_jax import _plot

        return _plot.plot(self, path, max_leaves=max_leaves)


def _pct(x: float) -> str:
    if x == 0:
        return "0"
    if x < 1e-4:
        return "<0.01%"
    return f"{100 * x:.2f}%"


def _fmt_scale(s: float | None) -> str:
    if s is None:
        return "-"
    e = math.log2(s)
    return f"2^{int(e)}" if e == int(e) else f"{s:g}"


def _at(d: Diagnosis, values: np.ndarray) -> float:
    return float(values[int(np.searchsorted(d.scales, d.scale))])


def _check_scales(scales: Any, scale: float) -> np.ndarray:
    grid = np.asarray(scales, np.float64)
    if grid.ndim != 1 or grid.size == 0:
        raise ValueError(f"scales must be a non-empty 1-d sequence of numbers, got {scales!r}.")
    if not (np.all(np.isfinite(grid)) and np.all(grid > 0)):
        raise ValueError(f"scales must be finite numbers > 0, got {scales!r}.")
    if np.any(grid > np.finfo(np.float32).max):
        raise ValueError(f"scales must fit in float32, got {scales!r}.")
    return np.unique(np.concatenate([grid, [1.0, scale]]).astype(np.float32)).astype(np.float64)


def _significant(g: jax.Array) -> jax.Array:
    """The entries of a reference gradient leaf above its rounding noise (``NOISE``)."""
    a = jnp.abs(g.astype(jnp.float32))
    return a > NOISE * jnp.max(a, initial=0.0)


def _reference_stats(g32: list[jax.Array]) -> tuple[jax.Array, ...]:
    """Per leaf of the reference gradient: max |g|, min nonzero |g|, nonzeros, histogram.

    The histogram of ``floor(log2|g|)`` over the nonzero entries of every leaf is one
    ``bincount`` of ``leaf * bins + exponent`` (one scatter, whatever the leaf count).
    Nonzero: above the rounding noise, ``|g| > NOISE * max|g|`` of the leaf.
    """
    big = jnp.finfo(jnp.float32).max
    maxes, mins, counts, index = [], [], [], []
    dump = len(g32) * _N_BINS  # the bin of zero entries, dropped
    for j, g in enumerate(g32):
        a = jnp.abs(g.astype(jnp.float32)).ravel()
        nonzero = _significant(g).ravel()
        maxes.append(jnp.max(a, initial=0.0))
        mins.append(jnp.min(jnp.where(nonzero, a, big), initial=big))
        counts.append(jnp.sum(nonzero, dtype=jnp.int32))
        exponent = jnp.frexp(jnp.where(nonzero, a, 1.0))[1] - 1  # floor(log2|g|)
        bins = j * _N_BINS + jnp.clip(exponent - LOG2_MIN, 0, _N_BINS - 1)
        index.append(jnp.where(nonzero, bins, dump))
    hist = jnp.bincount(jnp.concatenate(index), length=dump + 1)[:-1]
    return (
        jnp.stack(maxes),
        jnp.stack(mins),
        jnp.stack(counts),
        hist.reshape(len(g32), _N_BINS).astype(jnp.int32),
    )


def _make_batch_fn(loss_fn: Callable, reference: Callable, treedef, floats, rest, threshold):
    """The jitted per-batch computation: reference statistics, then counts per scale."""

    def params_of(float_leaves: list, leaves: list) -> Any:
        merged = list(leaves)
        for i, x in zip(floats, float_leaves, strict=True):
            merged[i] = x
        return jax.tree_util.tree_unflatten(treedef, merged)

    @jax.jit
    def batch_fn(float_leaves, other_leaves, batch, scales):
        leaves = [None] * (len(floats) + len(rest))
        for i, x in zip(rest, other_leaves, strict=True):
            leaves[i] = x
        wide = [numerics.at_least_float32(x.dtype) for x in float_leaves]
        ref_leaves = [x.astype(d) for x, d in zip(float_leaves, wide, strict=True)]

        def ref_loss(fl):
            return jnp.asarray(reference(params_of(fl, leaves), batch)).astype(jnp.float32)

        loss32, g32 = jax.value_and_grad(ref_loss)(ref_leaves)
        ref_nonzero = [_significant(g) for g in g32]

        def low_loss(fl, s):
            return jnp.asarray(loss_fn(params_of(fl, leaves), batch)).astype(jnp.float32) * s

        loss16 = jnp.asarray(loss_fn(params_of(float_leaves, leaves), batch)).astype(jnp.float32)

        def at_scale(s):
            g16 = jax.grad(low_loss)(float_leaves, s)
            under = [
                jnp.sum(jnp.logical_and(nz, g == 0), dtype=jnp.int32)
                for nz, g in zip(ref_nonzero, g16, strict=True)
            ]
            over = [
                jnp.sum(
                    jnp.logical_not(jnp.abs(g.astype(jnp.float32)) < threshold), dtype=jnp.int32
                )
                for g in g16
            ]
            return jnp.stack(under), jnp.stack(over)

        under, over = jax.lax.map(at_scale, scales)
        return (loss32, loss16, *_reference_stats(g32), under, over)

    return batch_fn


def diagnose(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    batches: Iterable[Any],
    *,
    scale: float = 2.0**15,
    scales: Sequence[float] | None = None,
    compute_dtype: Any = jnp.float16,
    reference_fn: Callable[[Any, Any], jax.Array] | None = None,
    tolerance: float = 1e-3,
    print_table: bool = True,
) -> Diagnosis:
    """Reports, per gradient leaf, what float16 loses and which loss scale fixes it.

    ``loss_fn(params, batch)`` is the loss the training step differentiates:
    ``params`` are the float32 master weights and the function computes in
    float16 itself (it casts the weights, or a Flax model built with
    ``dtype=jnp.float16`` does). The float32 reference is the same function
    with every float16 operation evaluated in float32: ``diagnose`` traces it
    and runs the traced program with float16 widened to float32 (casts,
    inputs, constants, ``dot_general``'s output type, ...), so there is one
    function to write. A function the rewrite cannot widen (a primitive it
    does not know, e.g. a custom kernel) raises ``ValueError``; pass
    ``reference_fn``, the float32 loss, then. Constants the program holds in
    float16 keep their float16 value in the reference (gelu's 0.044715 is
    0.044708; a loss weight of 1e-8 multiplied in float16 is 0 in both), so
    apply a small loss weight in float32, as the loss of a training step is.

    Rule (per batch; ``g`` the gradient with respect to ``params``)::

      g32     = grad(reference(params, batch))                 # float32
      g16(S)  = grad(float32(loss_fn(params, batch)) * S)      # float16 backward, S in scales
      nonzero = |g32| > eps(float32) * max|g32|  # per leaf: above float32's rounding noise
      underflow(leaf, S) = mean over nonzero of (g16(S) == 0)
      overflow(leaf, S)  = mean of (not |g16(S)| < finfo(compute_dtype).max)
      highest = the largest S such that no S' <= S overflows (any leaf, any batch)
      floor   = min of underflow(model, S) over S <= highest
      lowest  = the smallest S <= highest with underflow(model, S) <= floor + tolerance
      recommended = 2 ** round((log2 lowest + log2 highest) / 2)
      verdict = "float16 needs no scaling here"  if underflow(model, 1) <= floor + tolerance
                                                 and 1 overflows nothing
                "scale needed: ..."               if a range exists
                "... overflows ..."               otherwise

    A leaf whose float16 gradient overflows at every scale (its forward or
    backward pass exceeds 65504 whatever the scale) gets "this layer
    overflows at any scale: keep it in float32"; one that still loses more
    than ``tolerance`` at ``highest``, "underflows at every safe scale".

    A host-side tool, run before training: the work per batch is one jitted
    function (the reference gradient and ``lax.map`` over the scales, so one
    compilation for batches of one shape), and reading the results back
    synchronises with the device.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` computing in float16.
      params: the parameters (float32 master weights; any pytree).
      batches: a few batches (any pytrees ``loss_fn`` takes).
      scale: the loss scale in use (e.g. the policy's ``init_scale``); the
        table shows underflow and overflow at it.
      scales: the loss scales to try; default the powers of two from 2^-8 to
        2^24. 1 and ``scale`` are always added.
      compute_dtype: the dtype ``loss_fn`` computes in (float16; bfloat16 works
        the same way).
      reference_fn: optional float32 loss with ``loss_fn``'s signature, used
        instead of the rewrite.
      tolerance: the underflow fraction above the floor still counted as the
        floor (default 0.1% of the nonzero entries).
      print_table: print ``Diagnosis.table()`` (default True).

    Returns:
      A ``Diagnosis`` (per-leaf ``LeafDiagnosis`` rows, the model's range,
      recommendation and verdict; ``.table()``, ``.plot(path)``).

    Raises:
      ValueError: if ``batches`` is empty, ``scale``/``scales``/``tolerance``
        is out of range, ``loss_fn`` computes nothing in ``compute_dtype``
        with these params, its loss is not a scalar, or the float32 rewrite
        meets a primitive it cannot widen.
      TypeError: if ``loss_fn`` is not callable or ``params`` has no floating leaf.

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale_jax as lsj
      >>> def loss_fn(params, batch):              # float32 weights, float16 compute
      ...     x, y = batch
      ...     h = x @ params["w"].astype(jnp.float16)
      ...     return jnp.mean((h.astype(jnp.float32) - y) ** 2) * 1e-6   # a small loss weight
      >>> batch = (jnp.ones((8, 4), jnp.float16), jnp.zeros((8, 2)))
      >>> report = lsj.diagnose(loss_fn, {"w": jnp.full((4, 2), 0.01)}, [batch],
      ...                       print_table=False)
      >>> report.leaves[0].underflow_unscaled > 0.5          # lost without scaling
      True
      >>> lo, hi = report.init_scale_range
      >>> lo <= report.recommended_scale <= hi
      True
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function of (params, batch), got {loss_fn!r}.")
    if reference_fn is not None and not callable(reference_fn):
        raise TypeError(
            f"reference_fn must be a function of (params, batch), got {reference_fn!r}."
        )
    batches = list(batches)
    if not batches:
        raise ValueError("batches must hold at least one batch, got none.")
    scale = _one_scale(scale)
    grid = _check_scales(scales if scales is not None else 2.0 ** np.arange(-8, 25), scale)
    if not (isinstance(tolerance, int | float) and 0.0 <= tolerance < 1.0):
        raise ValueError(f"tolerance must be a fraction in [0, 1), got {tolerance!r}.")
    low = numerics.validate_compute_dtype(compute_dtype)
    threshold = float(jnp.finfo(low).max)

    flat_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [x for _, x in flat_with_path]
    floats = [i for i, x in enumerate(leaves) if numerics._is_float(x)]
    rest = [i for i in range(len(leaves)) if i not in floats]
    if not floats:
        raise TypeError("params has no floating leaf: there is no gradient to diagnose.")
    shape = jax.eval_shape(loss_fn, params, batches[0])
    got = getattr(shape, "shape", shape)
    if got != ():
        raise ValueError(f"loss_fn(params, batch) must return a scalar loss, got {got}.")
    if not _upcast.computes_in(loss_fn, (params, batches[0]), low):
        raise ValueError(
            f"loss_fn(params, batch) computes nothing in {low.name} with these params, so "
            f"there is nothing to diagnose: cast the master weights to {low.name} inside "
            f"loss_fn (p = jax.tree_util.tree_map(lambda a: a.astype(jnp.{low.name}), params)), "
            f"or build the model with dtype=jnp.{low.name}."
        )
    reference = reference_fn if reference_fn is not None else _upcast.upcast(loss_fn, low)
    if reference_fn is None:
        try:
            jax.eval_shape(reference, params, batches[0])
        except _upcast.UnsupportedPrimitive as e:
            raise ValueError(
                f"diagnose cannot evaluate loss_fn in float32: its program uses the primitive "
                f"{e.args[0]!r}, which the float32 rewrite does not handle. Pass "
                "reference_fn=, the same loss computed in float32."
            ) from None

    batch_fn = _make_batch_fn(loss_fn, reference, treedef, floats, rest, threshold)
    float_leaves = [leaves[i] for i in floats]
    other_leaves = [leaves[i] for i in rest]
    scales32 = jnp.asarray(grid, jnp.float32)
    results = [jax.device_get(batch_fn(float_leaves, other_leaves, b, scales32)) for b in batches]
    return _summarize(
        [jax.tree_util.keystr(flat_with_path[i][0]) for i in floats],
        [tuple(np.shape(leaves[i])) for i in floats],
        results,
        grid,
        scale,
        tolerance,
        print_table,
    )


def _one_scale(scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, int | float | np.number):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}.")
    if not (math.isfinite(float(scale)) and float(scale) > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}.")
    return float(np.float32(scale))


def _summarize(paths, shapes, results, grid, scale, tolerance, print_table) -> Diagnosis:
    loss_finite = all(bool(np.isfinite(r[1])) for r in results)
    max_abs = np.max([r[2] for r in results], axis=0)
    min_abs = np.min([r[3] for r in results], axis=0)
    nonzero = np.sum([r[4] for r in results], axis=0).astype(np.int64)
    hist = np.sum([r[5] for r in results], axis=0).astype(np.int64)
    under = np.sum([r[6] for r in results], axis=0).astype(np.int64)  # [scales, leaves]
    over = np.sum([r[7] for r in results], axis=0).astype(np.int64)
    sizes = np.asarray([math.prod(s) for s in shapes], np.int64) * len(results)

    leaf_under = under / np.maximum(nonzero, 1)
    leaf_over = over / np.maximum(sizes, 1)
    model_under = under.sum(axis=1) / max(int(nonzero.sum()), 1)
    model_over = over.sum(axis=1) / max(int(sizes.sum()), 1)

    safe = np.cumprod(model_over == 0).astype(bool)  # no overflow here nor at any smaller scale
    i1 = int(np.searchsorted(grid, 1.0))
    i_scale = int(np.searchsorted(grid, scale))
    if safe.any():
        top = int(np.nonzero(safe)[0][-1])
        floor = float(model_under[: top + 1].min())
        bottom = int(np.nonzero(model_under[: top + 1] <= floor + tolerance)[0][0])
        scale_range = (float(grid[bottom]), float(grid[top]))
        mid = round((math.log2(scale_range[0]) + math.log2(scale_range[1])) / 2)
        recommended = float(min(max(2.0**mid, scale_range[0]), scale_range[1]))
    else:
        top, floor, scale_range, recommended = None, float(model_under.min()), None, None

    leaves = []
    for j, path in enumerate(paths):
        every = bool(np.all(leaf_over[:, j] > 0))
        if every:
            verdict = OVERFLOWS
        elif top is not None and leaf_under[top, j] > tolerance:
            verdict = UNDERFLOWS
        elif leaf_under[i1, j] <= (leaf_under[top, j] if top is not None else 0) + tolerance and (
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
    elif model_under[i1] <= floor + tolerance and safe[i1]:
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
    )
    if print_table:
        print(diagnosis.table())
    return diagnosis
