"""The localizer of ``diagnose``: per tap, where float16 leaves its range, in network order.

For a model with taps (Flax modules, ``lsj.tap`` calls, the loss through ``scale_loss``) each
batch is run three more times with the taps recording: the float16 forward and backward pass
(forward statistics: does the activation overflow in float16?), and the float32 reference at
scale 1 and at the recommended scale (how much of each activation gradient is zero or
subnormal in float16). Rows come in the order the forward pass met the taps.

A module's output row says what left the range, not where: a float16 ``exp`` in the parent's
own code between two sub-modules makes the second one's input inf, and its output with it. So
the localizer also taps each Flax Linen module's input (``"<path> (input)"``, in these passes
only, through the same taps), and walks the forward pass's events in order (inputs and
outputs): the first one out of range is either a module's output (the module overflows: keep it
in float32) or a module's input (the code between the previous tap and that module overflows:
the caller's own code, which that advice names).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale_jax.engine import _tap_stats as layout
from lossscale_jax.engine._tap_stats import TapStats
from lossscale_jax.taps._tapping import Recorder, Select, recorder, tap_array


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
      input_overflows: whether the float16 input of the module's call was already out
        of range (the overflow happened before it, in the code that computed the input;
        Flax Linen modules, whose inputs the localizer taps).
    """

    name: str
    forward_max: float
    forward_max_reference: float
    forward_overflows: bool
    backward_max: float
    underflow_unscaled: float
    underflow_at_recommended: float
    input_overflows: bool = False


@dataclasses.dataclass(frozen=True)
class Overflow:
    """Where the float16 forward pass first leaves the range (the verdict's finding)."""

    tap: str  # the tap (row) there: out of range at its output, or already at its input
    at_input: bool  # already at the module's input: the overflow is in the code before it
    after: str | None  # the last tap in range before that code (forward order), if any
    owner: str | None  # the module whose own code computed the input (None: the loss function)
    reference_max: float  # the largest |value| there in the float32 reference
    reference_nonfinite: bool = False  # the reference has an inf or nan there too


INPUT = " (input)"
# A tap name: the module path, " (input)" for its input, "[i]" for one of several floating
# leaves, "#n" for its n-th call.
_NAME = re.compile(r"^(?P<base>.*?)(?P<input> \(input\))?(?:\[\d+\])?(?P<count>#\d+)?$")


def _split(name: str) -> tuple[bool, str]:
    """Whether ``name`` taps a module's input, and the row it belongs to (path and call)."""
    m = _NAME.match(name)
    if m is None:  # not reached: every part of the pattern is optional
        return False, name
    return m["input"] is not None, m["base"] + (m["count"] or "")


@contextlib.contextmanager
def _inputs_tapped(select: Select, callers: dict[str, str | None]) -> Iterator[None]:
    """Every selected Flax Linen module's ``__call__`` input tapped (floating arrays), and
    ``callers`` filled: per module call, the module whose code called it (``None``: none)."""
    linen = sys.modules.get("flax.linen")
    if linen is None:  # no Flax Linen model can be running
        yield
        return
    stack: list[str] = []
    calls: dict[str, int] = {}

    def interceptor(next_fun: Callable, args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        if context.method_name != "__call__" or module.is_initializing():
            return next_fun(*args, **kwargs)
        path = "/".join(str(p) for p in module.path) or type(module).__name__
        calls[path] = n = calls.get(path, 0) + 1
        key = path if n == 1 else f"{path}#{n}"  # the row's name (the taps' numbering)
        if select(module):
            callers[key] = stack[-1] if stack else None
            leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
            floating = [
                i
                for i, x in enumerate(leaves)
                if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)
            ]
            for k, i in enumerate(floating):
                tag = "" if len(floating) == 1 else f"[{k}]"
                leaves[i] = tap_array(leaves[i], f"{path}{INPUT}{tag}")
            args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        stack.append(key)
        try:
            return next_fun(*args, **kwargs)
        finally:
            stack.pop()

    with linen.intercept_methods(interceptor):
        yield


def with_inputs(fn: Callable, select: Select | None, callers: dict[str, str | None]) -> Callable:
    """``fn(params, batch)`` with the inputs of its Flax Linen modules tapped too."""
    if select is None:
        return fn

    def tapped(params: Any, batch: Any) -> Any:
        with _inputs_tapped(select, callers):
            return fn(params, batch)

    return tapped


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


def _total(runs: list[np.ndarray]) -> np.ndarray:
    return np.sum(runs, axis=0)


def _peak(runs: list[np.ndarray], index: int) -> np.ndarray:
    return np.max(np.stack(runs)[..., index], axis=0)


def _forward(
    names: tuple[str, ...], low: list[np.ndarray], reference: list[np.ndarray], threshold: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per tap: float16 has an inf or nan there; the float16 and float32 largest |value|;
    whether float16 leaves its range there; the reference has an inf or nan there.

    At a module's input, an inf or nan counts when the reference has fewer, or when it
    reaches the module's output (a -inf mask given to a softmax, in both passes, is no
    overflow)."""
    bad = _total(low)[:, layout.FWD_NONFINITE]
    ref_bad = _total(reference)[:, layout.FWD_NONFINITE]
    ref_max = _peak(reference, layout.FWD_MAX)
    split = [_split(n) for n in names]
    out_bad = {row for (at_input, row), b in zip(split, bad, strict=True) if not at_input and b}
    at_input = np.array([i for i, _ in split], bool)
    reaches = np.array([i and row in out_bad for i, row in split], bool)
    found = np.where(at_input, (bad > ref_bad) | ((bad > 0) & reaches), bad > 0)
    return bad > 0, _peak(low, layout.FWD_MAX), ref_max, found | (ref_max >= threshold), ref_bad > 0


def rows(
    names: tuple[str, ...],
    low: list[np.ndarray],
    reference: list[np.ndarray],
    reference_at: list[np.ndarray] | None,
    threshold: float,
) -> tuple[TapDiagnosis, ...]:
    """One row per tap from the per-batch ``[taps, WIDTH]`` statistics (a module's input
    taps, ``INPUT``, set its row's ``input_overflows`` and make no row of their own)."""

    def fraction(runs: list[np.ndarray]) -> np.ndarray:
        t = _total(runs)
        return t[:, layout.UNDERFLOW] / np.maximum(t[:, layout.NONZERO], 1.0)

    fwd_bad, fwd_low, fwd_ref, out_of_range, _ = _forward(names, low, reference, threshold)
    inputs_bad = {
        _split(n)[1] for n, bad in zip(names, out_of_range, strict=True) if bad and _split(n)[0]
    }
    under, under_at = fraction(reference), None
    if reference_at is not None:
        under_at = fraction(reference_at)
    backward_max = _peak(reference, layout.MAX)
    out = []
    for i, name in enumerate(names):
        if _split(name)[0]:
            continue
        out.append(
            TapDiagnosis(
                name=name,
                forward_max=float("inf") if fwd_bad[i] else float(fwd_low[i]),
                forward_max_reference=float(fwd_ref[i]),
                forward_overflows=bool(out_of_range[i]),
                backward_max=float(backward_max[i]),
                underflow_unscaled=float(under[i]),
                underflow_at_recommended=float("nan") if under_at is None else float(under_at[i]),
                input_overflows=name in inputs_bad,
            )
        )
    return tuple(out)


def first_overflow(
    names: tuple[str, ...],
    low: list[np.ndarray],
    reference: list[np.ndarray],
    threshold: float,
    callers: dict[str, str | None],
) -> Overflow | None:
    """Walking the forward pass's taps in order (modules' inputs and outputs): the first
    where the float16 value leaves the range, and the code that made it leave."""
    _, _, fwd_ref, out_of_range, ref_bad = _forward(names, low, reference, threshold)
    for i, name in enumerate(names):
        if not out_of_range[i]:
            continue
        at_input, row = _split(name)
        if not at_input:
            return Overflow(name, False, None, None, float(fwd_ref[i]))
        owner, after = callers.get(row), None
        for earlier in reversed(names[:i]):
            was_input, was = _split(earlier)
            if was_input and was == row:  # another leaf of the same input
                continue
            if not (was_input and was == owner):  # the owner's input: its code starts there
                after = f"the input of {was}" if was_input else earlier
            break
        return Overflow(row, True, after, owner, float(fwd_ref[i]), bool(ref_bad[i]))
    return None


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
            _mark(t),
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


def _mark(t: TapDiagnosis) -> str:
    if t.input_overflows:
        return "input inf/nan"  # its input left the range already: not this module's doing
    return "OVERFLOWS" if t.forward_overflows else ""


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
    hot: Overflow | None = None,
    note: str = "",
) -> str:
    """The model's verdict with the localizer's findings: where the float16 forward pass
    first leaves the range (``hot``: a module's output, or the code between two taps, instead
    of "the layers"), with ``note`` (a constant beyond float16's range) as the fix when there
    is one, and, when a scale is needed, where the backward gradients start to underflow."""
    if hot is not None:
        where, fix = _where(hot)
        fix = note or fix
        if not loss_finite:
            base = f"the float16 loss is not finite: {where}, which no loss scale fixes: {fix}"
        else:
            base = f"{base}; {where}: {fix}"
    elif note and not loss_finite:
        base = f"the float16 loss is not finite, which no loss scale fixes: {note}"
    cold = underflow_start(taps, tolerance) if scaling_needed else None
    if cold is not None:
        base += (
            f"; the backward gradients start to underflow at {cold.name} "
            f"({pct(cold.underflow_unscaled)} of its entries below 2^-14 without scaling)"
        )
    return base


def _where(hot: Overflow) -> tuple[str, str]:
    """Where the forward pass leaves the range, and the advice."""
    if not hot.at_input:
        where = (
            f"the float16 forward pass overflows first at {hot.tap} (max |activation| "
            f"{hot.reference_max:.3g} in float32, float16 ends at 65504)"
        )
        return where, f"keep {hot.tap} in float32"
    code = f"{hot.owner}'s own code" if hot.owner else "the loss function's own code"
    span = f"between {hot.after} and {hot.tap}" if hot.after else f"before {hot.tap}"
    ref = f"at most {hot.reference_max:.3g} in float32"
    if hot.reference_nonfinite:
        ref = "and in float32 too"
    where = (
        f"the float16 forward pass overflows first {span}, in {code} ({hot.tap}'s input is "
        f"already inf or nan in float16, {ref}: a value computed there leaves the range)"
    )
    who = hot.owner or "the loss function"
    if hot.reference_nonfinite:  # float32 does not hold it either
        return where, (
            f"make that code of {who} stable (subtract the largest value before an exp, as "
            f"jax.nn.softmax does): float32 overflows there too, and {hot.tap} is not the cause"
        )
    fix = (
        f"keep that code of {who} in float32 (cast to float32 before an exp or softmax "
        f"there, and back after), not {hot.tap}"
    )
    return where, fix
