"""The machinery of taps: the recorder a trace runs under, and the ``custom_vjp`` of a tap.

A tap is an identity whose ``custom_vjp`` takes a second, zero-valued input (its sink) and
returns the statistics of the cotangent as that input's "gradient"; differentiating with
respect to the sinks (``jax.grad`` over them) hands the statistics back, through ``jit``,
``pmap``, ``shard_map``, ``scan`` and ``remat`` like any gradient. No recorder, no tap: outside
``recording`` a tap returns its input untouched and the program has no trace of it.

The recorder lives in a context variable while a function is traced (a trace-time side
channel, as Flax's module scopes are). ``discover`` traces the function abstractly under a
recorder that only collects the names; ``recording`` hands each tap its sink. A name met
again in one trace gets ``#2``, ``#3``, the same in both traces because tracing is
deterministic.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import sys
from collections.abc import Callable, Iterator
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from lossscale_jax.engine._devices import pcast_to, varying_axes
from lossscale_jax.engine._tap_stats import WIDTH, TapStats, measure_backward, measure_forward
from lossscale_jax.errors import TapError


@dataclasses.dataclass
class Recorder:
    """What one trace of a tapped function collects (``sinks is None``) or feeds."""

    sinks: TapStats | None
    forward: bool = False
    names: list[str] = dataclasses.field(default_factory=list)
    dtypes: list[str] = dataclasses.field(default_factory=list)
    axes: list[frozenset] = dataclasses.field(default_factory=list)  # manual axes x varies over
    seen: dict[str, int] = dataclasses.field(default_factory=dict)
    linen: bool = False  # Linen modules are being tapped (installed once per recorder)
    # Per-layer scaling: the factor each named tap multiplies the backward signal by.
    factors: dict[str, Any] | None = None

    def claim(self, name: str) -> str:
        count = self.seen.get(name, 0) + 1
        self.seen[name] = count
        return name if count == 1 else f"{name}#{count}"


_ACTIVE: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "lossscale_jax_tap_recorder", default=None
)
# JAX caches what it traces (jit, checkpoint, scan bodies, eval_shape) by function and
# arguments; a tap's sink reaches it through the recorder, not an argument. Each recording
# sets this context to a value of its own, so no trace made under one recording (or none) is
# reused under another: a cached body would carry no taps, or another trace's sinks.
_TRACE_KEY = jax.make_user_context(None)
_RECORDINGS = itertools.count(1)


def _fwd_only(x: jax.Array, sink: jax.Array) -> tuple[jax.Array, None]:
    del sink
    return x, None


def _bwd_only(res: None, ct: jax.Array) -> tuple[jax.Array, jax.Array]:
    del res
    return ct, measure_backward(ct)


def _fwd_both(x: jax.Array, sink: jax.Array) -> tuple[jax.Array, jax.Array]:
    del sink
    return x, measure_forward(x)


def _bwd_both(res: jax.Array, ct: jax.Array) -> tuple[jax.Array, jax.Array]:
    return ct, measure_backward(ct) + res


def _identity(x: jax.Array, sink: jax.Array) -> jax.Array:
    del sink
    return x


def _scaled_identity(x: jax.Array, sink: jax.Array, factor: jax.Array) -> jax.Array:
    del sink, factor
    return x


def _fwd_scaled(x: jax.Array, sink: jax.Array, factor: jax.Array) -> tuple[jax.Array, Any]:
    del sink
    return x, factor


def _bwd_scaled(factor: jax.Array, ct: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    # Statistics of the signal as it arrives; then the layer's factor (a power of two:
    # exact unless it leaves the dtype's range), computed in float32 at least.
    wide = jnp.promote_types(ct.dtype, jnp.float32)
    out = (ct.astype(wide) * factor.astype(wide)).astype(ct.dtype)
    return out, measure_backward(ct), jnp.zeros_like(factor)


_tap_backward = jax.custom_vjp(_identity)
_tap_backward.defvjp(_fwd_only, _bwd_only)
_tap_both = jax.custom_vjp(_identity)
_tap_both.defvjp(_fwd_both, _bwd_both)
_tap_scaled = jax.custom_vjp(_scaled_identity)
_tap_scaled.defvjp(_fwd_scaled, _bwd_scaled)
# How the float32 rewrite of diagnose recognises a tap in a traced program: by its bwd.
_BWDS = {_bwd_only: _tap_backward, _bwd_both: _tap_both, _bwd_scaled: _tap_scaled}


def tap_of_equation(params: dict) -> Callable[[jax.Array, jax.Array], jax.Array] | None:
    """The tap function a ``custom_vjp_call`` equation binds, else ``None``."""
    bwd = getattr(params.get("bwd"), "f", None)
    return _BWDS.get(bwd) if bwd is not None else None


def tap_array(x: Any, name: str) -> Any:
    """One floating array through the active recorder (identity without one).

    Its callers hand it floating values only: ``tap_tree`` picks the floating leaves,
    ``lsj.tap`` refuses a non-floating array and ``scale_loss`` a non-floating loss.
    """
    rec = _ACTIVE.get()
    if rec is None:
        return x
    x = jnp.asarray(x)
    unique = rec.claim(name)
    axes = varying_axes(jax.typeof(x)) or frozenset()
    if rec.sinks is None:
        rec.names.append(unique)
        rec.dtypes.append(x.dtype.name)
        rec.axes.append(axes)
        return x
    try:
        index = rec.sinks.names.index(unique)
    except ValueError:
        raise TapError(
            f"the tap {unique!r} was not there when the sinks were made ({len(rec.sinks)} "
            f"taps: {', '.join(rec.sinks.names) or 'none'}): the function met other taps "
            "than when lsj.taps.discover traced it. Discover the sinks with the same "
            "function and arguments' shapes."
        ) from None
    sink = rec.sinks.values[index]
    if jnp.shape(sink) != (WIDTH,):
        raise TapError(
            f"the sink of tap {unique!r} has shape {jnp.shape(sink)}, expected ({WIDTH},): "
            "pass the sinks lsj.taps.discover made (one device's, not a pmapped stack)."
        )
    # Under shard_map the sink must vary where x does (its "gradient" does); a sink that
    # does not gets the sum over those devices (the transpose of the cast).
    sink = pcast_to(sink, axes)
    if rec.factors is not None and unique in rec.factors:
        return _tap_scaled(x, sink, jnp.asarray(rec.factors[unique], jnp.float32))
    fn = _tap_both if rec.forward else _tap_backward
    return fn(x, sink)


def tap_tree(tree: Any, name: str) -> Any:
    """Every floating array leaf of ``tree`` tapped (``name``, or ``name[i]`` for several)."""
    rec = _ACTIVE.get()
    if rec is None:
        return tree
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    floating = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, jax.Array | np.ndarray | float)
        and jnp.issubdtype(jnp.result_type(x), jnp.floating)
    ]
    out = list(leaves)
    for k, i in enumerate(floating):
        out[i] = tap_array(leaves[i], name if len(floating) == 1 else f"{name}[{k}]")
    return jax.tree_util.tree_unflatten(treedef, out)


Select = Callable[[Any], bool]


def validate_modules(modules: Any) -> Select | None:
    """``modules`` as a predicate on module instances (``None``: no module is tapped)."""
    if modules is True:
        return lambda m: True
    if modules is False:
        return None
    if callable(modules):
        return cast(Select, modules)
    raise TypeError(
        f"modules must be a bool or a predicate on modules (e.g. lambda m: isinstance(m, "
        f"Block)), got {modules!r}."
    )


@contextlib.contextmanager
def _linen_taps(select: Select) -> Iterator[None]:
    linen = sys.modules.get("flax.linen")
    if linen is None:  # no Flax Linen model can be running
        yield
        return

    def interceptor(next_fun: Callable, args: Any, kwargs: Any, context: Any) -> Any:
        out = next_fun(*args, **kwargs)
        module = context.module
        if context.method_name != "__call__" or module.is_initializing() or not select(module):
            return out
        return tap_tree(out, "/".join(str(p) for p in module.path) or type(module).__name__)

    with linen.intercept_methods(interceptor):
        yield


@contextlib.contextmanager
def _nnx_taps(model: Any, select: Select) -> Iterator[None]:
    """Every selected ``nnx.Module`` in ``model``'s graph tapped at its ``__call__``."""
    nnx = sys.modules.get("flax.nnx")  # loaded: the model is an NNX module
    if nnx is None or not isinstance(model, nnx.Module):
        raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}.")
    paths: dict[int, str] = {}
    owners: dict[type, Callable] = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and id(node) not in paths and select(node):
            paths[id(node)] = "/".join(str(p) for p in path) or type(node).__name__
            for cls in type(node).__mro__:
                if "__call__" in cls.__dict__:
                    owners.setdefault(cls, cls.__dict__["__call__"])
                    break

    def wrap(original: Callable) -> Callable:
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            name = paths.get(id(self))
            return out if name is None else tap_tree(out, name)

        return __call__

    for cls, original in owners.items():
        cls.__call__ = wrap(original)
    try:
        yield
    finally:
        for cls, original in owners.items():
            cls.__call__ = original


@contextlib.contextmanager
def recorder(rec: Recorder, modules: Select | None, model: Any) -> Iterator[Recorder]:
    """``rec`` active (and the module boundaries tapped) for the code inside."""
    token = _ACTIVE.set(rec)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_TRACE_KEY(next(_RECORDINGS)))
            if modules is not None and not rec.linen:
                stack.enter_context(_linen_taps(modules))
                rec.linen = True
                stack.callback(setattr, rec, "linen", False)
            if model is not None:
                stack.enter_context(_nnx_taps(model, modules or (lambda m: True)))
            yield rec
    finally:
        _ACTIVE.reset(token)


def active() -> Recorder | None:
    return _ACTIVE.get()


def sinks_of(rec: Recorder) -> TapStats:
    """The zero sinks of what a discovering recorder met, each varying where its tap's
    value varies (under shard_map), so each device gets its own statistics."""
    zeros = [pcast_to(jnp.zeros([WIDTH], jnp.float32), a) for a in rec.axes]
    return TapStats(rec.names, rec.dtypes, zeros)


@contextlib.contextmanager
def substituted(values: list[Any]) -> Iterator[None]:
    """The active recorder's taps fed ``values`` instead of its sinks (same names, fresh
    numbering): how a program traced inside the recording takes the sinks as inputs."""
    rec = _ACTIVE.get()
    assert rec is not None and rec.sinks is not None
    sinks = TapStats(rec.sinks.names, rec.sinks.dtypes, values)
    token = _ACTIVE.set(Recorder(sinks=sinks, forward=rec.forward, linen=rec.linen))
    try:
        with _TRACE_KEY(next(_RECORDINGS)):
            yield
    finally:
        _ACTIVE.reset(token)
