"""What the platform a step is lowered for decides without a conditional: the CPU's fence, and
a value computed two ways of which the program keeps one.

Primitives lowered per platform (a lowering rule per platform, as JAX registers
them), so that the choice follows the platform the step is *lowered* for, not the platforms the
process has: a step lowered for ``cuda`` from a CPU-only process (``lowering_platforms``,
``jax.export``, a deviceless compile) gets the GPU's, one lowered for the CPU in a GPU process
the CPU's. A step lowered for several platforms at once gets JAX's switch on the platform,
which the compiler resolves before it sees the program.

- ``fence_on_cpu(tree)``: the identity. Lowered for the CPU, one ``optimization_barrier`` over
  the tree's leaves (XLA fuses nothing across it); lowered for any other platform, no
  instruction at all.
- ``pick(default, on, platforms)``: ``default``, or ``on`` where the step is lowered for one of
  ``platforms``. Both are traced and lowered; the compiler drops the one not picked, which has
  no effect and no other use (dead code), so the program is the one the picked value alone
  compiles to. Unlike ``lax.platform_dependent`` it writes no conditional, not in the jaxpr and
  not in the program lowered for one platform: for a value cheap to trace twice.
- ``pick_when_lowered(default, on, platforms, operands, out)``: the same choice between two
  functions of ``operands``, each traced when the step is lowered, for a platform that keeps
  it (``mlir.lower_fun`` in the platform's lowering): the trace holds neither, the program the
  kept one alone. For the overflow check's flags (``_check_rows``); under a mesh, where
  ``out`` cannot say what the result's type holds, it is ``pick``.

- ``row_major_on_cpu(tree)``: the identity. Lowered for the CPU, each leaf of two or more
  dimensions in the default (row-major) layout (a ``with_layout_constraint``); lowered for any
  other platform, no instruction at all. For the operands of XLA:CPU's conditional: a gradient
  that the backward pass writes transposed (``x.T @ dy``, a float16 copy in column-major
  order, where the transpose is free) is written row-major by its producer's kernel, rather
  than copied into that order by a kernel of its own in the branch, which reads it row-major
  as the parameters and the optimizer's moments are (XLA:CPU's layout assignment does not
  carry the branch's order out of it).

- ``one_kernel_on_cpu(tree)``: the identity. Lowered for the CPU, the leaves of one shape are
  the outputs of one variadic reduction (each leaf stacked with the lowest value of its dtype
  and reduced by ``max``, or ``or`` for a flag: the value itself, bit for bit), into which
  XLA:CPU fuses each leaf's computation; lowered for any other platform, no instruction at
  all. For the loss-scale state a step returns: XLA:CPU compiles a kernel for each of its
  scalars otherwise (each output of a program is a kernel of its own there), some 20 ms of
  the first call apiece.

None traces a function twice: the fenced function is traced once, not once per branch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Layout, with_layout_constraint
from jax.interpreters import ad, batching, mlir

GPUS: tuple[str, ...] = ("cuda", "rocm")
"""XLA:GPU's platforms (JAX's names for them)."""

_NAMED: tuple[str, ...] = ("cpu", *GPUS, "tpu")
"""The platforms a choice's lowering is registered for by name (any other: the default's)."""


def _identity(*leaves: Any) -> list[Any]:
    return list(leaves)


def _identity_primitive(name: str) -> Any:
    """A primitive whose each output is its operand: eagerly (op by op, nothing is fused,
    laid out or fenced), in its avals (shapes, dtypes and, under shard_map, what varies),
    batched and differentiated (the tangents pass as they are: nothing here is a rounding),
    and lowered for every platform with no instruction; a platform's own lowering is
    registered beside it."""
    prim = jex_core.Primitive(name)
    prim.multiple_results = True
    prim.def_impl(_identity)
    prim.def_abstract_eval(_identity)
    batching.primitive_batchers[prim] = lambda args, dims: (prim.bind(*args), dims)
    ad.primitive_jvps[prim] = lambda primals, tangents: (prim.bind(*primals), list(tangents))
    mlir.register_lowering(prim, lambda ctx, *leaves: list(leaves))
    return prim


_fence_p = _identity_primitive("lossscale_jax_fence_on_cpu")


def _barrier(*leaves: Any) -> list[Any]:
    return list(jax.lax.optimization_barrier(list(leaves)))


mlir.register_lowering(_fence_p, mlir.lower_fun(_barrier, multiple_results=True), platform="cpu")


def fence_on_cpu(tree: Any) -> Any:
    """``tree`` as it is; lowered for the CPU, behind one ``optimization_barrier``."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    return jax.tree_util.tree_unflatten(treedef, _fence_p.bind(*leaves))


_row_major_p = _identity_primitive("lossscale_jax_row_major_on_cpu")


def _row_major(*leaves: Any) -> list[Any]:
    return [
        with_layout_constraint(x, Layout(tuple(range(x.ndim)))) if x.ndim >= 2 else x
        for x in leaves
    ]


_row_major_rule = mlir.lower_fun(_row_major, multiple_results=True)


def _row_major_cpu(ctx: Any, *leaves: Any) -> Any:
    # jax.export refuses the layout constraint's custom call: an exported step keeps XLA's
    # choice of layout (the copy in the branch), as does any lowering that does not say.
    params = getattr(getattr(ctx, "module_context", None), "lowering_parameters", None)
    if getattr(params, "for_export", True):
        return list(leaves)
    return _row_major_rule(ctx, *leaves)


mlir.register_lowering(_row_major_p, _row_major_cpu, platform="cpu")


def row_major_on_cpu(tree: Any) -> Any:
    """``tree`` as it is; lowered for the CPU, its leaves of two or more dimensions laid out
    row-major (the default layout)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    return jax.tree_util.tree_unflatten(treedef, _row_major_p.bind(*leaves))


# pick: operands (default, on); one result, the aval of ``default`` (``on`` has the same).
_pick_p = jex_core.Primitive("lossscale_jax_pick_by_platform")


@_pick_p.def_impl
def _first(default: Any, on: Any, *, platforms: tuple[str, ...]) -> Any:
    return default  # eagerly, on this process's default device: the default value


@_pick_p.def_abstract_eval
def _first_aval(default: Any, on: Any, *, platforms: tuple[str, ...]) -> Any:
    return default


def _pick_batched(args: Any, dims: Any, *, platforms: tuple[str, ...]) -> tuple[Any, Any]:
    size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None)
    front = [
        jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
        for x, d in zip(args, dims, strict=True)
    ]
    return _pick_p.bind(*front, platforms=platforms), 0


def _pick_jvp(primals: Any, tangents: Any, *, platforms: tuple[str, ...]) -> tuple[Any, Any]:
    return _pick_p.bind(*primals, platforms=platforms), tangents[0]


batching.primitive_batchers[_pick_p] = _pick_batched
ad.primitive_jvps[_pick_p] = _pick_jvp
mlir.register_lowering(_pick_p, lambda ctx, default, on, **_: [default])


def _register_pick(platform: str) -> None:
    def lowered(ctx: Any, default: Any, on: Any, *, platforms: tuple[str, ...]) -> Any:
        return [on] if platform in platforms else [default]

    mlir.register_lowering(_pick_p, lowered, platform=platform)


for _platform in _NAMED:
    _register_pick(_platform)


def pick(default: jax.Array, on: jax.Array, platforms: tuple[str, ...]) -> jax.Array:
    """``on`` where the step is lowered for a platform of ``platforms``, else ``default`` (of
    the same shape and dtype); the one not picked is dropped by the compiler."""
    if jnp.shape(default) != jnp.shape(on) or jnp.result_type(default) != jnp.result_type(on):
        raise ValueError(
            f"pick: the two values must have one shape and dtype, got "
            f"{jnp.result_type(default)}{jnp.shape(default)} and {jnp.result_type(on)}"
            f"{jnp.shape(on)}."
        )
    return _pick_p.bind(default, on, platforms=tuple(platforms))


# pick_when_lowered: operands as given; params (default, on: functions of them; platforms; the
# result's ShapeDtypeStruct). Traced when lowered, for the platform lowered for alone.
_lazy_p = jex_core.Primitive("lossscale_jax_pick_when_lowered")


@_lazy_p.def_impl
def _lazy_eagerly(*operands: Any, default: Any, on: Any, platforms: Any, out: Any) -> Any:
    return default(*operands)  # eagerly, on this process's default device: the default's


@_lazy_p.def_abstract_eval
def _lazy_aval(*operands: Any, default: Any, on: Any, platforms: Any, out: Any) -> Any:
    return jax.typeof(out)


def _lazy_batched(args: Any, dims: Any, **params: Any) -> tuple[Any, Any]:
    size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None)
    axes = [None if d is None else 0 for d in dims]
    front = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args, dims, strict=True)]
    out = params["out"]
    batched = _lazy_p.bind(
        *front,
        default=jax.vmap(params["default"], in_axes=axes),
        on=jax.vmap(params["on"], in_axes=axes),
        platforms=params["platforms"],
        out=jax.ShapeDtypeStruct((size, *out.shape), out.dtype),
    )
    return batched, 0


def _lazy_jvp(primals: Any, tangents: Any, **params: Any) -> tuple[Any, Any]:
    def both(*operands: Any) -> Any:  # the transformations see both, as pick traces them
        default, on = params["default"](*operands), params["on"](*operands)
        return pick(default, on, params["platforms"])

    return jax.jvp(both, tuple(primals), tuple(ad.instantiate_zeros(t) for t in tangents))


batching.primitive_batchers[_lazy_p] = _lazy_batched
ad.primitive_jvps[_lazy_p] = _lazy_jvp
mlir.register_lowering(
    _lazy_p, lambda ctx, *ops, default, **_: mlir.lower_fun(default, False)(ctx, *ops)
)


def _register_lazy(platform: str) -> None:
    def lowered(ctx: Any, *ops: Any, default: Any, on: Any, platforms: Any, out: Any) -> Any:
        return mlir.lower_fun(on if platform in platforms else default, False)(ctx, *ops)

    mlir.register_lowering(_lazy_p, lowered, platform=platform)


for _platform in _NAMED:
    _register_lazy(_platform)


def pick_when_lowered(
    default: Callable[..., jax.Array],
    on: Callable[..., jax.Array],
    platforms: tuple[str, ...],
    operands: Sequence[jax.Array],
    out: jax.ShapeDtypeStruct,
) -> jax.Array:
    """``pick(default(*operands), on(*operands), platforms)``, each function traced when the
    step is lowered, for a platform that keeps it, and not while the step is traced: neither
    costs the trace, and the one not kept costs nothing at all.

    ``default`` and ``on`` must be pure functions of ``operands`` (arrays), closing over no
    value of the step being traced (a tracer there would be out of its trace at lowering),
    with no effect, each returning one array of ``out``'s shape and dtype. Under a mesh
    (``shard_map``, ``pmap``, ``jax.set_mesh``) a result's type holds what the operands vary
    over or how they are sharded, which ``out`` does not say: there both are traced
    (:func:`pick`). Under ``vmap`` the functions are mapped; differentiated, both are traced.
    """
    if not jax.sharding.get_abstract_mesh().empty:
        return pick(default(*operands), on(*operands), platforms)
    return _lazy_p.bind(*operands, default=default, on=on, platforms=tuple(platforms), out=out)


_one_kernel_p = _identity_primitive("lossscale_jax_one_kernel_on_cpu")


def _lowest(dtype: Any) -> Any:
    """The identity of ``max`` (``or`` for bool) in ``dtype``; ``None`` for another kind."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return np.bool_(False)
    if jnp.issubdtype(dtype, jnp.integer):
        return np.array(np.iinfo(dtype).min, dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return np.array(-np.inf, dtype)
    return None


def _max_or(a: Any, b: Any) -> Any:
    return tuple(
        jnp.logical_or(x, y) if x.dtype == jnp.bool_ else jnp.maximum(x, y)
        for x, y in zip(a, b, strict=True)
    )


def _one_kernel(*leaves: Any) -> list[Any]:
    # max(lowest, x, lowest) is x, NaN and -0.0 included: the identity, as one reduction per
    # shape (a variadic reduction's operands share a shape, and its floats a precision: the
    # first float type takes the integers and flags along). A reduction over one element XLA
    # rewrites into a reshape, and so drops it; over the value and the reduction's identity it
    # keeps it, and its kernel computes the value once (stacked with itself, twice: the
    # kernel's code held each field's computation twice).
    out = list(leaves)
    groups: dict[tuple[tuple[int, ...], Any], list[int]] = {}
    for i, x in enumerate(leaves):
        if _lowest(x.dtype) is not None:
            floating = jnp.issubdtype(x.dtype, jnp.floating)
            groups.setdefault((tuple(x.shape), x.dtype if floating else None), []).append(i)
    for shape, precision in list(groups):
        floats = [k for k in groups if k[0] == shape and k[1] is not None]
        if precision is None and floats:
            groups[floats[0]] += groups.pop((shape, None))
    for where in groups.values():
        if len(where) < 2:
            continue
        inits = tuple(jnp.asarray(_lowest(leaves[i].dtype)) for i in where)
        stacked = tuple(
            jnp.stack([leaves[i], jnp.broadcast_to(low, leaves[i].shape)])
            for i, low in zip(where, inits, strict=True)
        )
        for i, value in zip(where, jax.lax.reduce(stacked, inits, _max_or, (0,)), strict=True):
            out[i] = value
    return out


mlir.register_lowering(
    _one_kernel_p, mlir.lower_fun(_one_kernel, multiple_results=True), platform="cpu"
)


IDENTITIES: frozenset[str] = frozenset(p.name for p in (_fence_p, _row_major_p, _one_kernel_p))
"""The primitives here whose each output is its operand, as the wiring check reads them."""


def one_kernel_on_cpu(tree: Any) -> Any:
    """``tree`` as it is; lowered for the CPU, its leaves of one shape computed by one kernel."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if len(leaves) < 2:
        return tree
    return jax.tree_util.tree_unflatten(treedef, _one_kernel_p.bind(*leaves))
