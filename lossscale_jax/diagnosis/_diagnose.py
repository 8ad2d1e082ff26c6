"""``diagnose``: the float32 reference and float16 at a range of scales, per gradient leaf.

Re-exported by ``lossscale_jax.diagnosis`` (its docstring tells the whole story).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale_jax import numerics
from lossscale_jax.diagnosis import _constants, _localizer, _report
from lossscale_jax.diagnosis._report import (
    _N_BINS,
    LOG2_MIN,
    NOISE,
    Diagnosis,
    summarize,
)
from lossscale_jax.engine._check import is_float
from lossscale_jax.engine._ops import where
from lossscale_jax.taps import Modules, _upcast, discover
from lossscale_jax.taps._tapping import validate_modules

SUBNORMAL_BINADES = 3
"""An entry this many binades or more below the compute dtype's smallest normal counts as
lost precision (float16: below 2**-17, 8 significant bits or fewer)."""


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
        mins.append(jnp.min(where(nonzero, a, big), initial=big))
        counts.append(jnp.sum(nonzero, dtype=jnp.int32))
        exponent = jnp.frexp(where(nonzero, a, 1.0))[1] - 1  # floor(log2|g|)
        bins = j * _N_BINS + jnp.clip(exponent - LOG2_MIN, 0, _N_BINS - 1)
        index.append(where(nonzero, bins, dump))
    hist = jnp.bincount(jnp.concatenate(index), length=dump + 1)[:-1]
    return (
        jnp.stack(maxes),
        jnp.stack(mins),
        jnp.stack(counts),
        hist.reshape(len(g32), _N_BINS).astype(jnp.int32),
    )


def _make_batch_fn(loss_fn: Callable, reference: Callable, treedef, floats, rest, threshold, low):
    """The jitted per-batch computation: reference statistics, then counts per scale."""
    tiny = float(jnp.finfo(low).tiny)

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
            # Deep in the compute dtype's subnormals: nonzero, 3 binades or more below its
            # smallest normal (float16: below 2**-17, 8 significant bits or fewer kept, less
            # than bfloat16 keeps), and a value that dtype holds (it passed through it).
            sub = [
                jnp.sum(
                    nz
                    & (g != 0)
                    & (jnp.abs(g.astype(jnp.float32)) < tiny * 2.0**-SUBNORMAL_BINADES)
                    & (g == g.astype(low).astype(g.dtype)),
                    dtype=jnp.int32,
                )
                for nz, g in zip(ref_nonzero, g16, strict=True)
            ]
            return jnp.stack(under), jnp.stack(over), jnp.stack(sub)

        under, over, sub = jax.lax.map(at_scale, scales)
        return (loss32, loss16, *_reference_stats(g32), under, over, sub)

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
    localize: bool = True,
    modules: Modules = True,
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
      subnormal(leaf, S) = mean over nonzero of (0 < |g16(S)| < finfo(compute_dtype).tiny / 8)
                           # float16: below 2**-17, 8 significant bits or fewer kept
      lost(S)  = underflow(model, S) + subnormal(model, S)   # zeros, and fewer bits kept
      overflow(leaf, S)  = mean of (not |g16(S)| < finfo(compute_dtype).max)
      highest = the largest S such that no S' <= S overflows (any leaf, any batch)
      floor   = min of lost(S) over S <= highest
      lowest  = the smallest S <= highest with lost(S) <= floor + tolerance
      recommended = 2 ** round((log2 lowest + log2 highest) / 2)
      verdict = "float16 needs no scaling here"  if lost(1) <= floor + tolerance
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
      localize: for a model with taps (Flax Linen modules, ``lsj.tap`` calls,
        ``lsj.scale_loss``), report per tap in forward order the float16 and
        float32 activation maxima and the activation gradient's underflow
        (``Diagnosis.taps``), and name in the verdict where the float16 forward
        pass first leaves the range (a module's output, or, the Linen modules'
        inputs being tapped too, the code between two modules) and where the
        backward gradients start to underflow. Three more passes per batch;
        ``False`` skips them. Whenever the float16 forward pass is not finite,
        the verdict also names a ``jnp.where`` whose constant float16 cannot
        hold (a mask of -1e9 becomes -inf), with the fix.
      modules: which Flax Linen modules the localizer taps (as
        ``lsj.taps.recording``: all, none, or a predicate on module instances).

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
    if not isinstance(localize, bool):
        raise TypeError(f"localize must be a bool, got {localize!r}.")
    validate_modules(modules)
    if not (isinstance(tolerance, int | float) and 0.0 <= tolerance < 1.0):
        raise ValueError(f"tolerance must be a fraction in [0, 1), got {tolerance!r}.")
    low = numerics.validate_compute_dtype(compute_dtype)
    threshold = float(jnp.finfo(low).max)

    flat_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [x for _, x in flat_with_path]
    floats = [i for i, x in enumerate(leaves) if is_float(x)]
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

    batch_fn = _make_batch_fn(loss_fn, reference, treedef, floats, rest, threshold, low)
    float_leaves = [leaves[i] for i in floats]
    other_leaves = [leaves[i] for i in rest]
    scales32 = jnp.asarray(grid, jnp.float32)
    results = [jax.device_get(batch_fn(float_leaves, other_leaves, b, scales32)) for b in batches]
    report = summarize(
        [jax.tree_util.keystr(flat_with_path[i][0]) for i in floats],
        [tuple(np.shape(leaves[i])) for i in floats],
        results,
        grid,
        scale,
        tolerance,
        False,
    )

    @functools.cache
    def note() -> str:  # a constant the float16 program holds as inf (one more trace)
        return _constants.advice(_constants.out_of_range(loss_fn, (params, batches[0]), low), low)

    if localize:
        report = _localize(report, loss_fn, reference, params, batches, threshold, modules, note)
    if not report.loss_finite and not report.taps and note():
        verdict = _localizer.verdict(report.verdict, False, (), report.tolerance, note=note())
        report = dataclasses.replace(report, verdict=verdict)
    if print_table:
        print(report.table())
    return report


def _localize(
    report: Diagnosis,
    loss_fn: Callable,
    reference: Callable,
    params: Any,
    batches: list[Any],
    threshold: float,
    modules: Any,
    note: Callable[[], str],
) -> Diagnosis:
    """``report`` with the localizer's rows and verdict (unchanged for a model without taps).

    The passes tap the Flax Linen modules' inputs too (``_localizer.with_inputs``): where a
    module's input is already out of range, the overflow is in the code before it."""
    select = validate_modules(modules)
    callers: dict[str, str | None] = {}
    loss_fn = _localizer.with_inputs(loss_fn, select, callers)
    reference = _localizer.with_inputs(reference, select, callers)
    sinks = discover(loss_fn, params, batches[0], modules=modules)
    if not len(sinks):
        return report
    low = _localizer.stats_fn(loss_fn, sinks, select)
    ref = _localizer.stats_fn(reference, sinks, select)
    one = jnp.float32(1.0)
    stats_low = [np.asarray(jax.device_get(low(params, b, one))) for b in batches]
    stats_ref = [np.asarray(jax.device_get(ref(params, b, one))) for b in batches]
    at = None
    if report.recommended_scale is not None:
        s = jnp.float32(report.recommended_scale)
        at = [np.asarray(jax.device_get(ref(params, b, s))) for b in batches]
    taps = _localizer.rows(sinks.names, stats_low, stats_ref, at, threshold)
    hot = _localizer.first_overflow(sinks.names, stats_low, stats_ref, threshold, callers)
    return dataclasses.replace(
        report,
        taps=taps,
        verdict=_localizer.verdict(
            report.verdict,
            report.loss_finite,
            taps,
            report.tolerance,
            scaling_needed=report.verdict != _report.NO_SCALING,
            hot=hot,
            note=note() if hot is not None or not report.loss_finite else "",
        ),
    )


def _one_scale(scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, int | float | np.number):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}.")
    if not (math.isfinite(float(scale)) and float(scale) > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}.")
    return float(np.float32(scale))
