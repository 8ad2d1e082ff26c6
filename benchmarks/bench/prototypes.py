"""Prototypes: the lossscale_jax steps with another overflow check or another step structure.

They are traced with the library's own pieces (through ``_library``) and choose formulations:
the library keeps the one that wins (docs/performance.md lists what was measured). None is in
the default run.

- Checks (``CHECKS``): ``grouped`` is the library's (same-shape leaves in one variadic
  reduction); ``perleaf`` the same reduction one leaf per kernel; ``mask`` the former
  ``not all(isfinite(g))``; ``sum`` is ``isnan(sum(g * 0))``; ``bits`` the integer max of the
  magnitude bits.
- Optax-path structures: ``noevalshape`` (the skip branch's zeros built from the parameters)
  and ``onetrace`` (``inner.update`` traced once, replayed from its jaxpr).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import lossscale_jax as lsj

from ._library import loss_scaling_parts, traced_with_check


def mask_flags(leaves, mode, threshold):
    """The former check: a single-output reduction per leaf (XLA:CPU splits it into a
    reduce-window and a reduce, and writes the elementwise mask in between)."""
    out = []
    for g in leaves:
        limit = jnp.asarray(threshold, g.dtype)
        if mode == "ieee":
            out.append(jnp.logical_not(jnp.all(jnp.isfinite(g))))
        elif mode == "saturating":
            out.append(jnp.any(jnp.abs(g) >= limit))
        else:
            out.append(jnp.logical_not(jnp.all(jnp.abs(g) < limit)))
    return out


def sum_flags(leaves, mode, threshold):
    """sum(g * 0) in the gradient's own dtype is 0, or nan when g holds inf or nan
    (ieee only; it never overflows: every term is +-0)."""
    if mode != "ieee":
        raise ValueError("the sum-based check exists for overflow='ieee' only")
    zero = [
        lax.reduce(
            g * jnp.zeros([], g.dtype), jnp.zeros([], g.dtype), lax.add, tuple(range(g.ndim))
        )
        for g in leaves
    ]
    return [jnp.isnan(z) for z in zero]


def bits_flags(leaves, mode, threshold):
    """Integer max of the magnitude bits (nan-safe: integers have no nan); single output."""
    out = []
    for g in leaves:
        bits = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[g.dtype.itemsize]
        sign = np.array(1, bits) << (8 * g.dtype.itemsize - 1)
        mag = lax.bitcast_convert_type(g, bits) & ~sign
        inf = lax.bitcast_convert_type(jnp.asarray(jnp.inf, g.dtype), bits)
        limit = lax.bitcast_convert_type(jnp.asarray(threshold, g.dtype), bits)
        if mode == "saturating":
            mag = jnp.where(mag > inf, jnp.zeros_like(mag), mag)  # nan is not counted
        top = jnp.max(mag)
        out.append(top >= (inf if mode == "ieee" else limit))
    return out


# name: the arguments of _library.traced_with_check (none: the library's own check).
CHECKS: dict[str, dict[str, Any]] = {
    "grouped": {},
    "perleaf": {"group": 1},  # the same variadic reduction, one leaf per kernel
    "mask": {"check": mask_flags},
    "sum": {"check": sum_flags},
    "bits": {"check": bits_flags},
}


def check_formulation(name: str) -> AbstractContextManager[None]:
    """Traces the library with the overflow check ``name`` of ``CHECKS`` (restored on exit)."""
    return traced_with_check(**CHECKS[name])


def _optax_path(branches: Callable) -> Callable:
    """The Optax path (``tx.update`` + ``apply_updates``) rebuilt from the library's parts, its
    conditional's branches made by ``branches(apply_inner, operands, params) -> (good, skip)``
    where ``apply_inner(operands)`` unscales and runs ``inner.update``."""

    def step(tx, grads, state, params):
        inner, decide = loss_scaling_parts(tx)
        loss_scale, apply, record = decide(grads, state.loss_scale, state.leaf_overflow)
        scale = state.loss_scale.scale

        def apply_inner(operands):
            g, inner_state = operands
            return inner.update(lsj.unscale(g, scale, params), inner_state, params)

        operands = (grads, state.inner_state)
        good, skip = branches(apply_inner, operands, params)
        updates, inner_state = lax.cond(apply, good, skip, operands)
        new_state = lsj.LossScalingState(loss_scale, inner_state, record)
        return optax.apply_updates(params, updates), new_state

    return step


def _zeros_from_params(apply_inner, operands, params):
    """The skip branch's zeros built from ``params`` (the updates of an Optax transformation
    have the parameters' structure; their dtypes are assumed to be the parameters'), so
    ``inner.update`` is traced once instead of twice."""

    def skip(operands):
        zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, p.dtype), params)
        return zeros, operands[1]

    return apply_inner, skip


def _traced_once(apply_inner, operands, params):
    """``inner.update`` traced once: ``make_jaxpr`` gives the good branch (replayed with
    ``eval_jaxpr``) and the exact shapes and dtypes of its updates (for the skip branch's
    zeros), where ``jax.eval_shape`` plus ``lax.cond`` trace it twice."""
    closed, out_shapes = jax.make_jaxpr(apply_inner, return_shape=True)(operands)
    out_tree = jax.tree_util.tree_structure(out_shapes)

    def good(operands):
        leaves = jax.tree_util.tree_leaves(operands)
        return jax.tree_util.tree_unflatten(
            out_tree, jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *leaves)
        )

    def skip(operands):
        zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), out_shapes[0])
        return zeros, operands[1]

    return good, skip


optax_path_without_eval_shape = _optax_path(_zeros_from_params)
optax_path_one_trace = _optax_path(_traced_once)


PROTOTYPES: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (check formulation, variants.variant_lsj keyword arguments)
    "proto_fused_mask": ("mask", {"fused": True, "mode": "ieee"}),
    "proto_optax_mask": ("mask", {"fused": False, "mode": "ieee"}),
    "proto_fused_perleaf": ("perleaf", {"fused": True, "mode": "ieee"}),
    "proto_fused_sum": ("sum", {"fused": True, "mode": "ieee"}),
    "proto_fused_bits": ("bits", {"fused": True, "mode": "ieee"}),
    "proto_optax_onetrace": (
        "grouped",
        {"fused": False, "mode": "ieee", "step": optax_path_one_trace},
    ),
    "proto_optax_noevalshape": (
        "grouped",
        {"fused": False, "mode": "ieee", "step": optax_path_without_eval_shape},
    ),
}


def tracing(variant: str) -> AbstractContextManager[None]:
    """The context ``variant``'s step is traced in: a prototype's check, else the library's."""
    if variant in PROTOTYPES:
        return check_formulation(PROTOTYPES[variant][0])
    return contextlib.nullcontext()
