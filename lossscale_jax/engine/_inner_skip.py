"""The Optax path's decision: the inner transformation's update, or a skipped step's.

A skipped step returns ``-0.0`` updates (``p + -0.0`` is ``p`` bit for bit, ``-0.0`` included)
and the inner state as it was. ``inner_or_skip`` takes that decision through the engine's one
``select`` (``Engine.select``); ``skip_updates`` builds the updates where a front-end skips
without one (inside a window that is not at its end).

Where the step has the parameters, a skipped step passes them through the branch in place of
its updates, and ``where(apply, u, -0.0)`` after the decision makes them ``-0.0``: a ``-0.0``
array built in a conditional's branch is a kernel per shape that XLA:CPU compiles (about 20 ms
each) though a skipped step alone runs it, where the select after it is fused into the
updates' consumer (``apply_updates``' add) and the parameters are copied in the skip branch
alone (tests/test_performance.py reads both from the compiled step). A step lowered for a GPU
(the select formulation) keeps its kernels and bytes, a select more per leaf fused into them
(``benchmarks/compiled_h100.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale_jax.engine import _skip
from lossscale_jax.engine._devices import varying_axes
from lossscale_jax.engine._engine import Engine
from lossscale_jax.engine._ops import where


def skip_updates(shapes: Any) -> Any:
    """The updates of a skipped step: ``-0.0`` for floating leaves, 0 for others.

    ``p + -0.0`` is ``p`` bit for bit for every ``p`` (``-0.0`` included), where
    ``p + 0.0`` turns ``-0.0`` into ``+0.0``. A constant either way: no cost at run time,
    but built in a conditional's branch it is a kernel per shape that XLA:CPU compiles
    (``inner_or_skip`` passes arrays through instead where it can).
    """
    return jax.tree_util.tree_map(_skip_leaf, shapes)


def _skip_leaf(s: Any) -> jax.Array:
    """A skipped step's update of ``s``'s shape and dtype (``skip_updates``)."""
    value = -0.0 if jnp.issubdtype(s.dtype, jnp.inexact) else 0
    return jax.lax.full(s.shape, value, s.dtype)


def inner_or_skip(
    engine: Engine,
    apply: jax.Array,
    inner_update: Callable,
    grads: Any,
    inner_state: Any,
    shapes: Any = None,
    like: Any = None,
) -> tuple[Any, Any]:
    """``inner_update(grads, inner_state)`` if ``apply``, else ``-0.0`` updates and the
    inner state as it was (e.g. Adam's count unchanged): the Optax path's conditional.

    ``shapes``: ``jax.eval_shape(inner_update, grads, inner_state)``, where the caller has it.
    ``like``: arrays the step has anyway (the parameters), where the caller has them. An update
    leaf of one's shape and dtype is, on a skipped step, that array passed through the branch
    and replaced by ``-0.0`` after the decision (``where(apply, u, -0.0)``, which XLA fuses
    into the update's consumer, ``apply_updates``' add): no ``-0.0`` array is built in the
    branch, whose kernel per shape XLA:CPU compiles (some 20 ms each) though a skipped step
    alone runs it. The updates are the same either way.
    """

    @_skip.traced_once  # for its shapes here, and in every formulation's branch
    def good(operands: Any) -> Any:
        return inner_update(*operands[:2])

    operands = (grads, inner_state, like)  # like: one operand, in each use of good's trace
    if shapes is None:
        shapes = _skip.shapes_of(good, operands)
    passed = _passed_through(shapes[0], like)

    def skip(operands: Any) -> Any:
        if not any(passed):
            return skip_updates(shapes[0]), operands[1]
        wanted, tree = jax.tree_util.tree_flatten(shapes[0])
        stand_ins = jax.tree_util.tree_leaves(operands[2])
        leaves = [
            a if p else _skip_leaf(w) for w, a, p in zip(wanted, stand_ins, passed, strict=True)
        ]
        return jax.tree_util.tree_unflatten(tree, leaves), operands[1]

    updates, inner_state = engine.select(apply, good, skip, operands, good_shapes=shapes)
    if not any(passed):
        return updates, inner_state
    leaves, tree = jax.tree_util.tree_flatten(updates)
    leaves = [
        where(apply, u, _skip_leaf(u)) if p else u for u, p in zip(leaves, passed, strict=True)
    ]
    return jax.tree_util.tree_unflatten(tree, leaves), inner_state


def _passed_through(updates: Any, like: Any) -> list[bool]:
    """Per update leaf: whether ``like`` (of the updates' structure) has an array of its
    shape and floating dtype, varying over no ``shard_map`` axis the update does not, to pass
    through a skipped step in its place (the branches' outputs vary over the union of what
    theirs vary over: a varying parameter would make replicated updates varying)."""
    leaves = jax.tree_util.tree_leaves(updates)
    if like is None or jax.tree_util.tree_structure(like) != jax.tree_util.tree_structure(updates):
        return [False] * len(leaves)

    def fits(u: Any, a: Any) -> bool:
        if not isinstance(a, jax.Array | np.ndarray):
            return False
        if not jnp.issubdtype(u.dtype, jnp.inexact) or (a.shape, a.dtype) != (u.shape, u.dtype):
            return False
        extra = varying_axes(jax.typeof(a)) or frozenset()
        return extra <= (varying_axes(u) or frozenset())

    return [fits(u, a) for u, a in zip(leaves, jax.tree_util.tree_leaves(like), strict=True)]
