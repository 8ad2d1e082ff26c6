"""The CPU's fence: an ``optimization_barrier`` where a step is lowered for the CPU, nothing
elsewhere.

``fence_on_cpu(tree)`` is the identity on every platform. Lowered for the CPU it is one
``optimization_barrier`` over the tree's leaves (XLA fuses nothing across it); lowered for any
other platform it is no instruction at all. Which one is decided by the platform the step is
*lowered* for (a lowering rule per platform, as JAX registers them), not by the platforms the
process has: a step lowered for ``cuda`` from a CPU-only process (``lowering_platforms``,
``jax.export``, a deviceless compile) has no barrier, and one lowered for the CPU in a GPU
process has it. A step lowered for several platforms at once gets JAX's switch on the
platform, which the compiler resolves before it sees the program.

It is a primitive rather than a ``lax.platform_dependent`` between a fenced and an unfenced
branch: the fenced function is traced once (not once per branch), and the program lowered
for one platform holds no conditional, not even ``platform_dependent``'s constant one.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.extend.core as jex_core
from jax.interpreters import ad, batching, mlir

_fence_p = jex_core.Primitive("lossscale_jax_fence_on_cpu")
_fence_p.multiple_results = True


@_fence_p.def_impl
def _identity(*leaves: Any) -> list[Any]:
    return list(leaves)  # run eagerly, op by op: nothing is fused, nothing to fence


@_fence_p.def_abstract_eval
def _same_avals(*avals: Any) -> list[Any]:
    return list(avals)  # shapes, dtypes and (under shard_map) what varies: as they were


def _batched(args: Any, dims: Any) -> tuple[Any, Any]:
    return _fence_p.bind(*args), dims


def _jvp(primals: Any, tangents: Any) -> tuple[Any, Any]:
    # The tangents pass unfenced: nothing here is a rounding the barrier keeps apart.
    return _fence_p.bind(*primals), list(tangents)


def _barrier(*leaves: Any) -> list[Any]:
    return list(jax.lax.optimization_barrier(list(leaves)))


batching.primitive_batchers[_fence_p] = _batched
ad.primitive_jvps[_fence_p] = _jvp
mlir.register_lowering(_fence_p, lambda ctx, *leaves: list(leaves))  # every platform
mlir.register_lowering(_fence_p, mlir.lower_fun(_barrier, multiple_results=True), platform="cpu")


def fence_on_cpu(tree: Any) -> Any:
    """``tree`` as it is; lowered for the CPU, behind one ``optimization_barrier``."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    return jax.tree_util.tree_unflatten(treedef, _fence_p.bind(*leaves))
