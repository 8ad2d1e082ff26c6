"""Which layer taps each parameter's gradient passes on its way back from the loss.

Per-layer scaling multiplies the backward signal at each layer tap by its own factor, so a
parameter's gradient arrives scaled by the product of the factors of the taps between it and
the loss. That product is one number only if every path from the parameter to the loss passes
the same taps: taps at cut points of the network (a block's output on the residual stream, a
layer's output in a chain). This module reads it off the traced program: it walks the jaxpr
of the loss, carrying for each value the set of taps each parameter leaf reached it through,
and refuses a leaf whose paths disagree (tied weights, a tap on one branch of a residual).

In a chain the sets are suffixes of the forward order (a layer's parameters pass its own tap
and every later one); the segment of a leaf is the first tap it passes (``len(names)``, the
loss's segment, for a leaf that passes none).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp

from lossscale_jax.engine._jaxprs import ClosedJaxpr
from lossscale_jax.engine._tap_stats import TapStats
from lossscale_jax.errors import TapError
from lossscale_jax.taps._tapping import Recorder, recorder, tap_of_equation, validate_modules
from lossscale_jax.taps._upcast import INLINE_CALLS

MIXED = None  # the marker of a leaf whose paths pass different taps
Deps = dict[int, frozenset | None]  # leaf -> taps passed (MIXED: paths disagree)


def _merge(maps: Sequence[Deps]) -> Deps:
    out: Deps = {}
    for m in maps:
        for leaf, taps in m.items():
            if leaf not in out:
                out[leaf] = taps
            elif out[leaf] != taps:
                out[leaf] = MIXED
    return out


def _contains_tap(jaxpr: jcore.Jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if tap_of_equation(eqn.params) is not None:
            return True
        if any(_contains_tap(sub) for sub in jcore.jaxprs_in_params(eqn.params)):
            return True
    return False


def _walk(jaxpr: jcore.Jaxpr, ins: list[Deps], sink_tap: dict[Any, int]) -> list[Deps]:
    env: dict[Any, Deps] = dict(zip(jaxpr.invars, ins, strict=True))

    def read(v: Any) -> Deps:
        return {} if isinstance(v, jcore.Literal) else env.get(v, {})

    for eqn in jaxpr.eqns:
        args = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if tap_of_equation(eqn.params) is not None:
            consts = eqn.params.get("num_consts", 0)
            sink = eqn.invars[consts + 1]
            j = sink_tap.get(sink)
            x = args[consts]
            outs = [{k: (t if t is MIXED or j is None else t | {j}) for k, t in x.items()}]
        elif name in INLINE_CALLS and INLINE_CALLS[name] in eqn.params:
            body = eqn.params[INLINE_CALLS[name]]
            inner = body.jaxpr if isinstance(body, ClosedJaxpr) else body
            # the sinks of taps inside a call are the call's operands: map them through
            inner_sinks = {
                iv: sink_tap[ov]
                for iv, ov in zip(inner.invars, eqn.invars, strict=False)
                if not isinstance(ov, jcore.Literal) and ov in sink_tap
            }
            outs = _walk(inner, args[: len(inner.invars)], {**sink_tap, **inner_sinks})
        else:
            subs = jcore.jaxprs_in_params(eqn.params)
            if any(_contains_tap(s) for s in subs):
                raise TapError(
                    f"per-layer scaling cannot follow a layer tap inside {name!r} (scan, "
                    "while, cond): put the layer taps outside it, e.g. tap the scanned "
                    "stack's output, not each iteration."
                )
            merged = _merge(args)
            outs = [merged for _ in eqn.outvars]
        for v, d in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, jcore.DropVar):
                env[v] = d
    return [read(v) for v in jaxpr.outvars]


def segments_of(
    fun: Callable[..., Any],
    params: Any,
    args: tuple,
    names: Sequence[str],
    modules: Any,
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Per floating leaf of ``params`` (in ``tree_leaves`` order): its segment (the first layer
    tap its gradient passes, or ``len(names)``); and the leaves' paths. Raises ``TapError`` for
    a leaf whose paths to the loss pass different taps, or taps that are not a suffix of
    ``names`` (the taps are not cut points of a chain)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [x for _, x in flat]
    paths = tuple(jax.tree_util.keystr(p) for p, _ in flat)
    sinks = TapStats.zeros(names, ["float32"] * len(names))
    select = validate_modules(modules)

    def traced(sink_values: list, leaves: list) -> Any:
        stats = TapStats(sinks.names, sinks.dtypes, sink_values)
        with recorder(Recorder(sinks=stats), select, None):
            return fun(jax.tree_util.tree_unflatten(treedef, leaves), *args)

    closed = jax.make_jaxpr(traced)(list(sinks.values), leaves)
    jaxpr = closed.jaxpr
    sink_vars = jaxpr.invars[: len(names)]
    leaf_vars = jaxpr.invars[len(names) :]
    ins: list[Deps] = [{} for _ in sink_vars]
    for i, _ in enumerate(leaf_vars):
        ins.append({i: frozenset()})
    (out,) = _walk(jaxpr, ins, {v: j for j, v in enumerate(sink_vars)})
    n = len(names)
    segments = []
    for i, leaf in enumerate(leaves):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):  # no gradient
            segments.append(n)
            continue
        taps = out.get(i, frozenset())
        if taps is None:
            raise TapError(
                f"per-layer scaling: the gradient of {paths[i]} reaches the loss through "
                "different layer taps on different paths (tied weights, or a tap on one branch "
                "of a residual): its scale would not be one number. Tap cut points (a block's "
                "output on the residual stream), or leave the module out with modules=."
            )
        first = min(taps) if taps else n
        if taps != frozenset(range(first, n)):
            raise TapError(
                f"per-layer scaling: the gradient of {paths[i]} passes the layer taps "
                f"{sorted(str(names[j]) for j in taps)}, not the tap it meets first and every one "
                "after it: the layer taps are not a chain in forward order."
            )
        segments.append(first)
    return tuple(segments), paths
