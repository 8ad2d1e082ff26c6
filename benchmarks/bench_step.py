"""Cost of loss scaling per training step, against the plain step a user runs and the JAX peers.

One command regenerates ``benchmarks/results.md`` and ``results.json``::

  python benchmarks/bench_step.py

It runs every case once per allocator, each allocator in a child process of its own
(the environment is set before Python starts): the default glibc malloc, glibc tuned to
keep freed memory (``MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2**30``)
and, where the library is installed (Debian ``libtcmalloc-minimal4``), tcmalloc
through ``LD_PRELOAD``. In a child, every variant of a case is compiled, then all run
interleaved over several rounds (the order rotates each round), so machine noise hits
them alike. Reported per variant: the median over rounds of the round's ratio to the plain
step (and its range), median ms, minor page faults per step, compile time (CPU seconds of
trace + lower + compile, measured in the first child only: the others read a shared
compilation cache), temporaries (``memory_analysis()``), and from the compiled HLO the
conditionals, parameter-sized copies and selects, kernels (fusions) and an estimate of the
bytes a good step moves. A variant whose loss went non-finite over the timed steps, whose
parameters or optimizer state hold a non-finite value, or whose loss scale moved (or that
skipped a step) is refused: it gets no timing. The run ends with a target-by-target check.

Variants:
  plain            what a user runs without loss scaling: gradients cast to the parameter
                   dtype, then optax.adam and apply_updates
  lsj_optax_*      lossscale_jax.loss_scaling: tx.update + optax.apply_updates
  lsj_fused_*      lossscale_jax.apply_gradients (update applied inside the conditional)
  jmp              jmp.DynamicLossScale + jmp.all_finite + jmp.select_tree
  flax             flax DynamicScale.value_and_grad + the documented jnp.where skip
  optax_if_finite  optax.apply_if_finite(adam) with a static scale
  proto_*          (not in the default run) the lossscale_jax steps with another overflow
                   check or step structure, to choose formulations: see PROTOTYPES
  lsj_*_headroom_ieee  (not in the default run) the lossscale_jax steps with HeadroomScale
                   held at the benchmark's scale (the whole rule runs, the scale stays put)

Workloads, layouts, gradient patterns, steps:
  mlp_20m   4 dense layers, 18.9M params, 8 leaves;  deep_300: 150 residual layers of
            width 140, 2.96M params, 300 leaves;  mlp_1m / tiny / tiny_deep: smaller
  in_out    kernels stored [in, out] and applied as ``h @ kernel`` (Flax ``nn.Dense``)
  out_in    kernels stored [out, in] and applied as ``h @ kernel.T`` (torch.nn.Linear)
  fp16grad  gradients taken w.r.t. the float16 copy of float32 master weights
  fp32grad  gradients taken w.r.t. the float32 params, cast inside the loss (what Flax's
            ``dtype=float16, param_dtype=float32`` modules give)
  full      forward + backward + scaler + Adam + apply;  post: scaler + Adam + apply on
            precomputed (scaled) gradients

Usage::

  python benchmarks/bench_step.py                        # the full run (see README.md)
  python benchmarks/bench_step.py --quick --out /tmp/b   # smoke run, in-process (a minute)
  python benchmarks/bench_step.py --cases mlp_20m/in_out/fp16grad/post \\
      --variants plain lsj_fused_ieee proto_fused_mask --allocators glibc_tuned
  python benchmarks/bench_step.py --check-report         # overflow-check formulations alone
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import lossscale_jax as lsj
from lossscale_jax import numerics

F16 = jnp.float16
F32 = jnp.float32
INIT_SCALE = 2.0**12
LR = 1e-4
BATCH = 32
HERE = Path(__file__).resolve().parent

# --------------------------------------------------------------------------
# Workloads.

WORKLOADS: dict[str, dict[str, Any]] = {
    "mlp_1m": {"kind": "mlp", "widths": [384, 1024, 512, 256, 16]},
    "mlp_20m": {"kind": "mlp", "widths": [2048, 4096, 2048, 1024, 16]},
    "deep_300": {"kind": "resnet", "width": 140, "depth": 150},
    "tiny": {"kind": "mlp", "widths": [32, 64, 32, 16, 8]},
    "tiny_deep": {"kind": "resnet", "width": 16, "depth": 20},
}
LAYOUTS = ("in_out", "out_in")
PATTERNS = ("fp16grad", "fp32grad")
KINDS = ("full", "post")

# The default run: the four headline cases (targets), the other layout and the fp32
# gradient pattern on the 20M model.
DEFAULT_CASES = (
    "mlp_20m/in_out/fp16grad/full",
    "mlp_20m/in_out/fp16grad/post",
    "deep_300/in_out/fp16grad/full",
    "deep_300/in_out/fp16grad/post",
    "mlp_20m/out_in/fp16grad/full",
    "mlp_20m/in_out/fp32grad/full",
)
QUICK_CASES = ("tiny/in_out/fp16grad/full", "tiny/in_out/fp16grad/post")


def dense_shapes(widths: list[int], layout: str) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    for a, b in zip(widths[:-1], widths[1:], strict=True):
        shapes += [(a, b) if layout == "in_out" else (b, a), (b,)]
    return shapes


def init_params(spec: dict[str, Any], layout: str, rng: np.random.Generator) -> dict:
    params = {}
    if spec["kind"] == "mlp":
        for i, shape in enumerate(dense_shapes(spec["widths"], layout)):
            fan_in = spec["widths"][i // 2]
            std = np.sqrt(2.0 / fan_in) if len(shape) == 2 else 0.01
            params[f"{i:03d}"] = jnp.asarray(rng.normal(0.0, std, shape), F32)
    else:
        w = spec["width"]
        for i in range(spec["depth"]):
            params[f"{2 * i:03d}"] = jnp.asarray(rng.normal(0.0, 0.02, (w, w)), F32)
            params[f"{2 * i + 1:03d}"] = jnp.asarray(rng.normal(0.0, 0.01, (w,)), F32)
    return params


def make_loss(spec: dict[str, Any], layout: str) -> Callable:
    """A float16 forward pass; the loss comes back in float32."""

    def dense(h, kernel, bias):
        return (h @ kernel if layout == "in_out" else h @ kernel.T) + bias

    def forward(p, x):
        leaves = [p[k] for k in sorted(p)]
        h = x
        if spec["kind"] == "mlp":
            n = len(leaves) // 2
            for i in range(n):
                h = dense(h, leaves[2 * i], leaves[2 * i + 1])
                if i < n - 1:
                    h = jax.nn.relu(h)
        else:
            for i in range(len(leaves) // 2):
                h = h + jnp.tanh(dense(h, leaves[2 * i], leaves[2 * i + 1]))
        return h

    def loss(p16, x, y):
        return jnp.mean(jnp.square(forward(p16, x) - y).astype(F32))

    return loss


def make_batch(spec: dict[str, Any], rng: np.random.Generator) -> tuple[jax.Array, jax.Array]:
    d_in, d_out = (
        (spec["widths"][0], spec["widths"][-1]) if spec["kind"] == "mlp" else (spec["width"],) * 2
    )
    x = jnp.asarray(rng.normal(size=(BATCH, d_in)), F16)
    y = jnp.asarray(rng.normal(size=(BATCH, d_out)) * 0.1, F16)
    return x, y


def to16(tree):
    return jax.tree_util.tree_map(lambda a: a.astype(F16), tree)


def cast_like(grads, params):
    return jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), grads, params)


def value_and_grads(loss, params, x, y, pattern, scale):
    """The (unscaled) loss and the gradients of ``loss * scale`` in the user's pattern."""

    def scaled(p):
        value = loss(to16(p) if pattern == "fp32grad" else p, x, y)
        return (value if scale is None else value * scale), value

    target = params if pattern == "fp32grad" else to16(params)
    (_, value), grads = jax.value_and_grad(scaled, has_aux=True)(target)
    return value, grads


# --------------------------------------------------------------------------
# Variants. Each returns (full, post, init, scale_of):
#   full(params, state, x, y) -> (params, state, loss)
#   post(params, state, grads) -> (params, state)
#   scale_of(state) -> (loss scale, steps skipped so far) as host numbers, or None


def variant_plain(loss, pattern):
    adam = optax.adam(LR)

    def post(params, state, grads):
        updates, state = adam.update(cast_like(grads, params), state, params)
        return optax.apply_updates(params, updates), state

    def full(params, state, x, y):
        value, grads = value_and_grads(loss, params, x, y, pattern, None)
        return (*post(params, state, grads), value)

    return full, post, adam.init, lambda s: None


def _lsj_scale_of(state):
    m = lsj.metrics(state)
    return float(m["loss_scale"]), int(m["skipped_steps"])


def _headroom_pinned() -> lsj.LossScalePolicy:
    """``HeadroomScale`` held at ``INIT_SCALE`` (min = max): the whole rule runs (the range in
    the check, the packed reduction, the target) and the scale stays put, so the timed steps
    are comparable with the others."""
    return lsj.HeadroomScale(init_scale=INIT_SCALE, min_scale=INIT_SCALE, max_scale=INIT_SCALE)


def variant_lsj(loss, pattern, *, fused: bool, mode: str, step=None, policy=None):
    policy = lsj.DynamicScale(init_scale=INIT_SCALE) if policy is None else policy()
    tx = lsj.loss_scaling(optax.adam(LR), policy, overflow=mode)

    def post(params, state, grads):
        if step is not None:
            return step(tx, grads, state, params)
        if fused:
            return lsj.apply_gradients(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def full(params, state, x, y):
        scale = lsj.get_loss_scale_state(state).scale
        value, grads = value_and_grads(loss, params, x, y, pattern, scale)
        return (*post(params, state, grads), value)

    return full, post, tx.init, _lsj_scale_of


def variant_jmp(loss, pattern):
    import jmp

    adam = optax.adam(LR)

    # The state crosses jit as plain arrays (jmp's own unflatten rejects
    # the placeholders that jit.lower passes through it).
    def init(params):
        return (adam.init(params), (jnp.asarray(INIT_SCALE, F32), jnp.zeros([], jnp.int32)))

    def post(params, state, grads):
        opt_state, (scale, counter) = state
        loss_scale = jmp.DynamicLossScale(scale, counter)
        grads = loss_scale.unscale(cast_like(grads, params))
        finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        updates, new_opt_state = adam.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(
            finite, (new_params, new_opt_state), (params, opt_state)
        )
        return params, (opt_state, (loss_scale.loss_scale, loss_scale.counter))

    def full(params, state, x, y):
        value, grads = value_and_grads(loss, params, x, y, pattern, state[1][0])
        return (*post(params, state, grads), value)

    def scale_of(state):
        # jmp keeps no skip count; a skip lowers the scale, which is checked.
        return float(state[1][0]), 0

    return full, post, init, scale_of


def variant_flax(loss, pattern):
    from flax.training import dynamic_scale

    adam = optax.adam(LR)

    def init(params):
        return (adam.init(params), (jnp.zeros([], jnp.int32), jnp.asarray(INIT_SCALE, F32)))

    def step_with(params, state, grad_fn, *args):
        opt_state, (fin_steps, scale) = state
        dyn = dynamic_scale.DynamicScale(fin_steps=fin_steps, scale=scale)
        dyn, is_fin, value, grads = dyn.value_and_grad(grad_fn)(*args)
        updates, new_opt_state = adam.update(cast_like(grads, params), opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # The documented pattern (flax examples): jnp.where over every leaf.
        select = functools.partial(jnp.where, is_fin)
        params = jax.tree_util.tree_map(select, new_params, params)
        opt_state = jax.tree_util.tree_map(select, new_opt_state, opt_state)
        return params, (opt_state, (dyn.fin_steps, dyn.scale)), value

    def full(params, state, x, y):
        def fn(p):
            return loss(to16(p) if pattern == "fp32grad" else p, x, y)

        target = params if pattern == "fp32grad" else to16(params)
        return step_with(params, state, fn, target)

    @jax.custom_vjp
    def given(p, g):  # a function whose gradient w.r.t. p is the precomputed g
        return jnp.zeros([], F32)

    given.defvjp(
        lambda p, g: (jnp.zeros([], F32), g),
        lambda g, ct: (g, jax.tree_util.tree_map(jnp.zeros_like, g)),
    )

    def post(params, state, grads):
        target = jax.tree_util.tree_map(lambda g: jnp.zeros(g.shape, g.dtype), grads)

        return step_with(params, state, given, target, grads)[:2]

    def scale_of(state):
        return float(state[1][1]), 0

    return full, post, init, scale_of


def variant_if_finite(loss, pattern):
    tx = optax.apply_if_finite(optax.adam(LR), max_consecutive_errors=10**6)
    scale = jnp.float32(INIT_SCALE)

    def post(params, state, grads):
        grads = jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype) / scale, grads, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def full(params, state, x, y):
        value, grads = value_and_grads(loss, params, x, y, pattern, scale)
        return (*post(params, state, grads), value)

    def scale_of(state):
        return INIT_SCALE, int(state.total_notfinite)

    return full, post, tx.init, scale_of


# --------------------------------------------------------------------------
# Prototypes: the lossscale_jax steps with another overflow check, or another step
# structure, traced with the library's own pieces. They choose formulations; the
# library keeps the one that wins (docs/performance.md lists what was measured).


def _mask_flags(leaves, mode, threshold):
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


def _sum_flags(leaves, mode, threshold):
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


def _bits_flags(leaves, mode, threshold):
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


CHECKS: dict[str, Callable | None] = {
    "grouped": None,  # the library's check (numerics._leaf_flags)
    "perleaf": "perleaf",  # the same variadic reduction, one leaf per kernel
    "mask": _mask_flags,
    "sum": _sum_flags,
    "bits": _bits_flags,
}


def _flags_only(check: Callable) -> Callable:
    """``check`` in ``numerics._leaf_flags``'s signature; these formulations measure no range."""

    def leaf_flags(leaves, mode, threshold, with_max=False):
        if with_max:
            raise NotImplementedError("the alternative checks measure no range (HeadroomScale)")
        return check(leaves, mode, threshold)

    return leaf_flags


@contextlib.contextmanager
def check_formulation(name: str) -> Iterator[None]:
    """Traces the library with another overflow check (restored on exit)."""
    saved = (numerics._leaf_flags, numerics._GROUP)
    try:
        if name == "perleaf":
            numerics._GROUP = 1
        elif CHECKS[name] is not None:
            numerics._leaf_flags = _flags_only(CHECKS[name])
        yield
    finally:
        numerics._leaf_flags, numerics._GROUP = saved


def optax_path_without_eval_shape(tx, grads, state, params):
    """The Optax path with the skip branch's zeros built from ``params`` (the updates of
    an Optax transformation have the parameters' structure; their dtypes are assumed to
    be the parameters'), so ``inner.update`` is traced once instead of twice."""
    from lossscale_jax.transform import LossScalingState

    parts = tx.update.loss_scaling_parts
    loss_scale, apply, record = parts.decide(grads, state.loss_scale, state.leaf_overflow)
    scale = state.loss_scale.scale

    def good(operands):
        g, inner_state = operands
        return parts.inner.update(numerics.unscale(g, scale, params), inner_state, params)

    def skip(operands):
        zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, p.dtype), params)
        return zeros, operands[1]

    updates, inner = lax.cond(apply, good, skip, (grads, state.inner_state))
    return optax.apply_updates(params, updates), LossScalingState(loss_scale, inner, record)


def optax_path_one_trace(tx, grads, state, params):
    """The Optax path with ``inner.update`` traced once: ``make_jaxpr`` gives the good
    branch (replayed with ``eval_jaxpr``) and the exact shapes and dtypes of its updates
    (for the skip branch's zeros), where ``jax.eval_shape`` plus ``lax.cond`` trace it
    twice."""
    from lossscale_jax.transform import LossScalingState

    parts = tx.update.loss_scaling_parts
    loss_scale, apply, record = parts.decide(grads, state.loss_scale, state.leaf_overflow)
    scale = state.loss_scale.scale

    def apply_inner(operands):
        g, inner_state = operands
        return parts.inner.update(numerics.unscale(g, scale, params), inner_state, params)

    operands = (grads, state.inner_state)
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

    updates, inner = lax.cond(apply, good, skip, operands)
    return optax.apply_updates(params, updates), LossScalingState(loss_scale, inner, record)


PROTOTYPES: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (check formulation, variant_lsj keyword arguments)
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
    # HeadroomScale (the range measured in the check's reductions), not in the default run.
    "lsj_fused_headroom_ieee": (
        "grouped",
        {"fused": True, "mode": "ieee", "policy": _headroom_pinned},
    ),
    "lsj_optax_headroom_ieee": (
        "grouped",
        {"fused": False, "mode": "ieee", "policy": _headroom_pinned},
    ),
}

VARIANTS: dict[str, Callable] = {
    "plain": variant_plain,
    "lsj_optax_ieee": functools.partial(variant_lsj, fused=False, mode="ieee"),
    "lsj_optax_saturating": functools.partial(variant_lsj, fused=False, mode="saturating"),
    "lsj_fused_ieee": functools.partial(variant_lsj, fused=True, mode="ieee"),
    "lsj_fused_saturating": functools.partial(variant_lsj, fused=True, mode="saturating"),
    "jmp": variant_jmp,
    "flax": variant_flax,
    "optax_if_finite": variant_if_finite,
}
DEFAULT_VARIANTS = tuple(VARIANTS)
for _name, (_check, _kw) in PROTOTYPES.items():
    VARIANTS[_name] = functools.partial(variant_lsj, **_kw)

PEERS = ("jmp", "flax", "optax_if_finite")

# --------------------------------------------------------------------------
# HLO reading.

_COMP = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\) -> .* \{$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|f16|bf16|s32|u32|f32|s64|u64|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2}
_BYTES |= {"s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
# Instructions that move no data of their own.
_FREE = {
    "parameter",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "constant",
    "conditional",
    "call",
    "while",
    "after-all",
    "partition-id",
    "replica-id",
}


def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        total += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def parse_hlo(text: str) -> tuple[dict[str, list[dict]], str]:
    comps: dict[str, list[dict]] = {}
    cur = entry = None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            cur = m.group(1)
            comps[cur] = []
            entry = cur if line.startswith("ENTRY") else entry
            continue
        m = _INSTR.match(line) if cur else None
        if m:
            name, shape, op, rest = m.groups()
            args = rest.split("),")[0] if op != "conditional" else rest
            comps[cur].append(
                {
                    "name": name,
                    "shape": shape,
                    "op": op,
                    "rest": rest,
                    "operands": re.findall(r"%([\w.\-]+)", args.split(")")[0]),
                }
            )
    return comps, entry


def bytes_moved(text: str) -> int:
    """Bytes read and written by the kernels a good step runs (an estimate: each
    top-level instruction's operands and result, once; conditionals: the branch that
    moves more, i.e. the update)."""
    comps, entry = parse_hlo(text)

    def walk(comp: str) -> int:
        shapes = {i["name"]: i["shape"] for i in comps[comp]}
        total = 0
        for ins in comps[comp]:
            if ins["op"] == "conditional":
                branches = re.findall(
                    r"%([\w.\-]+)", ins["rest"].split("branch_computations={")[1].split("}")[0]
                )
                total += max(walk(b) for b in branches)
            elif ins["op"] not in _FREE:
                total += _shape_bytes(
                    ins["shape"].split("{")[0] if "(" not in ins["shape"] else ins["shape"]
                )
                total += sum(_shape_bytes(shapes.get(o, "")) for o in ins["operands"])
        return total

    return walk(entry)


def hlo_stats(text: str, param_shapes: set[str]) -> dict[str, int]:
    comps, _ = parse_hlo(text)
    stats = {
        "conditionals": 0,
        "param_sized_copies": 0,
        "param_sized_selects": 0,
        "kernels": 0,
        "instructions": 0,
    }
    for comp in comps.values():
        for ins in comp:
            stats["instructions"] += 1
            shape = ins["shape"].split("{")[0]
            op = ins["op"]
            stats["conditionals"] += op == "conditional"
            stats["kernels"] += op == "fusion"
            stats["param_sized_copies"] += op == "copy" and shape in param_shapes
            stats["param_sized_selects"] += op == "select" and shape in param_shapes
    stats["bytes_moved"] = bytes_moved(text)
    return stats


def shape_strings(params) -> set[str]:
    out = set()
    for p in jax.tree_util.tree_leaves(params):
        dims = ",".join(str(d) for d in p.shape)
        out |= {f"f32[{dims}]", f"f16[{dims}]"}
    return out


# --------------------------------------------------------------------------
# One case, in this process.


def _copy(tree):
    return jax.tree_util.tree_map(jnp.copy, tree)


def _all_finite(tree) -> bool:
    leaves = [
        x
        for x in jax.tree_util.tree_leaves(tree)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return all(bool(jnp.all(jnp.isfinite(x))) for x in leaves)


def _trace_context(name: str):
    return (
        check_formulation(PROTOTYPES[name][0]) if name in PROTOTYPES else contextlib.nullcontext()
    )


def run_case(
    case: str,
    variants: list[str],
    rounds: int,
    iters: int,
    measure_compile: bool,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    workload, layout, pattern, kind = case.split("/")
    spec = WORKLOADS[workload]
    rng = np.random.default_rng(0)
    params = init_params(spec, layout, rng)
    n_params = int(sum(p.size for p in jax.tree_util.tree_leaves(params)))
    n_leaves = len(jax.tree_util.tree_leaves(params))
    x, y = make_batch(spec, rng)
    loss = make_loss(spec, layout)
    if kind == "post":
        gdtype = F16 if pattern == "fp16grad" else F32
        # Scaled gradients as the backward pass would give them (|g| ~ 0.5 * 2**12 / 2**12).
        extra = (
            jax.tree_util.tree_map(
                lambda p: jnp.asarray(rng.normal(size=p.shape) * 0.5, gdtype), params
            ),
        )
    else:
        extra = (x, y)
    pshapes = shape_strings(params)

    runs: dict[str, dict[str, Any]] = {}
    for name in variants:
        full, post, init, scale_of = VARIANTS[name](loss, pattern)
        fn = full if kind == "full" else post
        state = init(params)
        args = (_copy(params), state, *extra)
        if measure_compile:  # from scratch: no executable or trace kept from an earlier variant
            jax.clear_caches()
        cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
        entries = len(os.listdir(cache)) if cache else 0
        c0, w0 = time.process_time(), time.perf_counter()
        with _trace_context(name):
            compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(*args).compile()
        compile_cpu, compile_wall = time.process_time() - c0, time.perf_counter() - w0
        # A variant whose HLO equals an earlier one's is read from the compilation cache
        # (nothing new is written): its compile time is not measured.
        measured = measure_compile and not (cache and len(os.listdir(cache)) == entries)
        mem = compiled.memory_analysis()
        out = compiled(*args)  # warm-up step
        jax.block_until_ready(out)
        runs[name] = {
            "compiled": compiled,
            "carry": out[:2],
            "losses": [out[2]] if kind == "full" else [],
            "times": [],
            "faults": 0,
            "round_ms": [],
            "scale_of": scale_of,
            "compile_cpu_s": compile_cpu if measured else None,
            "compile_wall_s": compile_wall if measured else None,
            "temp_bytes": int(mem.temp_size_in_bytes) if mem else None,
            **hlo_stats(compiled.as_text(), pshapes),
        }
        log(f"  compiled {name:24s} cpu {compile_cpu:7.2f} s  wall {compile_wall:7.2f} s")

    order = list(variants)
    for r in range(rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            run = runs[name]
            times = []
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(iters):
                t0 = time.perf_counter()
                out = run["compiled"](*run["carry"], *extra)
                jax.block_until_ready(out)
                times.append(time.perf_counter() - t0)
                run["carry"] = out[:2]
                if kind == "full":
                    run["losses"].append(out[2])
            run["faults"] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
            run["times"] += times
            run["round_ms"].append(statistics.median(times) * 1e3)

    rows = []
    plain_rounds = runs["plain"]["round_ms"]
    for name in variants:
        run = runs[name]
        refused = []
        if not all(bool(jnp.isfinite(v)) for v in run["losses"]):
            refused.append("loss went non-finite")
        if not _all_finite(run["carry"]):
            refused.append("non-finite parameters or optimizer state")
        moved = run["scale_of"](run["carry"][1])
        if moved is not None and (moved[0] != INIT_SCALE or moved[1] != 0):
            refused.append(f"loss scale moved to {moved[0]} / {moved[1]} skipped steps")
        ratios = [v / p for v, p in zip(run["round_ms"], plain_rounds, strict=True)]
        rows.append(
            {
                "case": case,
                "workload": workload,
                "layout": layout,
                "pattern": pattern,
                "kind": kind,
                "variant": name,
                "params": n_params,
                "leaves": n_leaves,
                "median_ms": statistics.median(run["times"]) * 1e3,
                "min_ms": min(run["times"]) * 1e3,
                "ratio": statistics.median(ratios),
                "ratio_lo": min(ratios),
                "ratio_hi": max(ratios),
                "faults_per_step": run["faults"] / len(run["times"]),
                "compile_cpu_s": run["compile_cpu_s"],
                "compile_wall_s": run["compile_wall_s"],
                "temp_bytes": run["temp_bytes"],
                **{
                    k: run[k]
                    for k in (
                        "conditionals",
                        "param_sized_copies",
                        "param_sized_selects",
                        "kernels",
                        "instructions",
                        "bytes_moved",
                    )
                },
                "samples": len(run["times"]),
                "refused": "; ".join(refused) or None,
            }
        )
    return rows


# --------------------------------------------------------------------------
# The overflow check alone: formulations side by side.


def check_report(rounds: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    for workload in ("mlp_20m", "deep_300"):
        params = init_params(WORKLOADS[workload], "in_out", np.random.default_rng(0))
        grads = jax.tree_util.tree_map(lambda p: p.astype(F16), params)
        n = sum(g.size for g in jax.tree_util.tree_leaves(grads))
        comp = {}
        for name in CHECKS:
            c0 = time.process_time()
            with check_formulation(name):
                compiled = jax.jit(lambda g: lsj.check_overflow(g, "ieee")).lower(grads).compile()
            cpu = time.process_time() - c0
            compiled(grads).block_until_ready()
            stats = hlo_stats(compiled.as_text(), set())
            comp[name] = (compiled, cpu, stats, compiled.memory_analysis().temp_size_in_bytes)
        times: dict[str, list[float]] = {k: [] for k in comp}
        for r in range(rounds):
            for name in list(comp)[r % len(comp) :] + list(comp)[: r % len(comp)]:
                t0 = time.perf_counter()
                comp[name][0](grads).block_until_ready()
                times[name].append(time.perf_counter() - t0)
        base = statistics.median(times["grouped"])
        for name, (_, cpu, stats, temp) in comp.items():
            med = statistics.median(times[name])
            rows.append(
                {
                    "workload": workload,
                    "check": name,
                    "median_ms": med * 1e3,
                    "x_grouped": med / base,
                    "compile_cpu_s": cpu,
                    "temp_bytes_per_param": temp / n,
                    "kernels": stats["kernels"],
                    "bytes_moved_per_param": stats["bytes_moved"] / n,
                }
            )
            log(
                f"  {workload:9s} {name:8s} {med * 1e3:8.2f} ms  x{med / base:5.2f}  "
                f"compile {cpu:5.2f} s  temp {temp / n:5.2f} B/param  kernels {stats['kernels']}"
            )
    return rows


# --------------------------------------------------------------------------
# Where the compile time goes: the post step built up one piece at a time.

COMPILE_REPEATS = 3


def _skeletons() -> dict[str, tuple[str, Callable, Callable]]:
    """Post steps from the plain one towards the library's, each adding one piece.

    ``name: (what it adds, step, init)``; a step is ``(params, state, grads) -> ...`` with
    float16 grads and float32 params. Past ``plain`` the state is ``(adam_state, scale)``: the
    scale is read at run time, as the library reads it.
    """
    adam = optax.adam(LR)

    def init(params):
        return adam.init(params), jnp.asarray(INIT_SCALE, F32)

    def unscaled(params, state, grads):
        adam_state, scale = state
        inv = 1.0 / scale
        grads = jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype) * inv, grads, params)
        updates, adam_state = adam.update(grads, adam_state, params)
        return optax.apply_updates(params, updates), (adam_state, scale)

    def keep(params, state, grads):
        return params, state

    def cond(params, state, grads):
        ok = jnp.isfinite(state[1])  # a predicate that reads no gradient
        return lax.cond(ok, unscaled, keep, params, state, grads)

    def check_cond(params, state, grads):
        flags = numerics._leaf_vector(grads)  # what loss_scaling checks and records
        ok = jnp.logical_not(jnp.any(flags))
        return (*lax.cond(ok, unscaled, keep, params, state, grads), flags)

    return {
        "plain": (
            "cast, Adam, apply (the baseline)",
            variant_plain(None, "fp16grad")[1],
            adam.init,
        ),
        "skel_unscale": ("+ unscale by a scale read at run time", unscaled, init),
        "skel_cond": ("+ lax.cond on a predicate that reads no gradient", cond, init),
        "skel_check_cond": (
            "+ the overflow check as the predicate, its per-leaf record",
            check_cond,
            init,
        ),
    }


def compile_report(workload: str, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Compile CPU seconds of the post step built up piece by piece, then the library's.

    Every step is compiled from scratch (``jax.clear_caches``) ``COMPILE_REPEATS`` times and
    the minimum is kept: compile times scatter by +-25% between identical compiles.
    """
    spec = WORKLOADS[workload]
    rng = np.random.default_rng(0)
    params = init_params(spec, "in_out", rng)
    grads = jax.tree_util.tree_map(lambda p: jnp.asarray(rng.normal(size=p.shape), F16), params)
    steps = _skeletons()
    loss = make_loss(spec, "in_out")
    for name, what in (
        ("lsj_fused_ieee", "the library's fused step (policy, counters, record)"),
        ("lsj_optax_ieee", "the library's Optax path (tx.update, apply_updates)"),
        ("optax_if_finite", "optax.apply_if_finite (peer)"),
    ):
        _, post, init, _ = VARIANTS[name](loss, "fp16grad")
        steps[name] = (what, post, init)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(COMPILE_REPEATS):
        for name, (_, fn, init) in steps.items():
            args = (_copy(params), init(params), grads)
            jax.clear_caches()
            c0 = time.process_time()
            jax.jit(fn, donate_argnums=(0, 1)).lower(*args).compile()
            times[name].append(time.process_time() - c0)
    base = min(times["plain"])
    rows = []
    for name, (what, _, _) in steps.items():
        best = min(times[name])
        rows.append(
            {
                "workload": workload,
                "step": name,
                "adds": what,
                "compile_cpu_s": best,
                "all_s": times[name],
                "x_plain": best / base,
            }
        )
        log(f"  {workload:9s} {name:18s} compile {best:6.2f} s  x{best / base:5.2f}")
    return rows


def compile_table(report: list[dict[str, Any]] | None) -> str:
    if not report:
        return ""
    lines = [
        f"| step ({report[0]['workload']}, post) | adds | compile s, min of {COMPILE_REPEATS} "
        "| x plain | all compiles, s |",
        "|---|---|---:|---:|---|",
    ]
    for r in report:
        every = ", ".join(f"{t:.2f}" for t in r["all_s"])
        lines.append(
            f"| {r['step']} | {r['adds']} | {r['compile_cpu_s']:.2f} | {r['x_plain']:.2f} "
            f"| {every} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Allocators, children, targets, tables.

ALLOCATOR_LIBS = {
    "tcmalloc": ("libtcmalloc_minimal.so.4",),
    "jemalloc": ("libjemalloc.so.2",),
}
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")


def allocator_env(name: str) -> dict[str, str] | None:
    """The environment that selects an allocator, or None where it is not installed."""
    if name == "default":
        return {}
    if name == "glibc_tuned":
        # One arena: XLA:CPU allocates from its worker threads, and a non-main glibc arena
        # serves a block larger than its 64 MiB heap by mmap whatever MMAP_MAX says.
        return {
            "MALLOC_ARENA_MAX": "1",
            "MALLOC_MMAP_MAX_": "0",
            "MALLOC_TRIM_THRESHOLD_": str(2**30),
        }
    for lib in ALLOCATOR_LIBS.get(name, ()):
        for d in LIB_DIRS:
            path = Path(d) / lib
            if path.exists():
                env = {"LD_PRELOAD": str(path)}
                if name == "jemalloc":
                    env["MALLOC_CONF"] = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
                return env
    return None


ALLOCATORS = ("default", "glibc_tuned", "tcmalloc", "jemalloc")
DEFAULT_ALLOCATORS = ("default", "glibc_tuned", "tcmalloc")

# (label, variants, step, targets apply to): ratio bars on the headline cases.
RATIO_TARGETS = (
    ("fused", ("lsj_fused_ieee", "lsj_fused_saturating"), "full", 1.10),
    ("fused", ("lsj_fused_ieee", "lsj_fused_saturating"), "post", 1.30),
    ("Optax path", ("lsj_optax_ieee", "lsj_optax_saturating"), "full", 1.20),
    ("Optax path", ("lsj_optax_ieee", "lsj_optax_saturating"), "post", 1.60),
)
HEADLINE = tuple(c for c in DEFAULT_CASES if "/in_out/fp16grad/" in c)


def targets(rows: list[dict[str, Any]], allocators: list[str]) -> list[tuple[str, str, str]]:
    """(target, measured, met) for every target the run covers."""
    out = []
    by = {(r["allocator"], r["case"], r["variant"]): r for r in rows}
    cases = [c for c in HEADLINE if any(r["case"] == c for r in rows)]
    for alloc in allocators:
        for label, names, kind, bar in RATIO_TARGETS:
            for case in [c for c in cases if c.endswith("/" + kind)]:
                got = [by.get((alloc, case, n)) for n in names]
                got = [g for g in got if g is not None]
                if not got:
                    continue
                bad = [g for g in got if g["refused"]]
                text = ", ".join(
                    f"{g['variant'].rsplit('_', 1)[1]} {g['ratio']:.2f}x"
                    f" ({g['ratio_lo']:.2f}-{g['ratio_hi']:.2f})"
                    for g in got
                )
                met = (
                    "refused"
                    if bad
                    else ("yes" if all(g["ratio"] <= bar for g in got) else "**no**")
                )
                out.append(
                    (f"{label} {kind} <= {bar:.2f}x, {case.split('/')[0]}, {alloc}", text, met)
                )
        for case in cases:
            ours = [
                r
                for (a, c, v), r in by.items()
                if a == alloc and c == case and v.startswith("lsj_")
            ]
            peers = [by[(alloc, case, p)] for p in PEERS if (alloc, case, p) in by]
            if not ours or not peers:
                continue
            best_peer = min(peers, key=lambda r: r["median_ms"])
            worst = max(ours, key=lambda r: r["ratio"])
            ok = all(o["ratio"] < p["ratio"] for o in ours for p in peers)
            out.append(
                (
                    f"ahead of jmp, Flax, apply_if_finite: {case}, {alloc}",
                    f"slowest ours {worst['variant']} {worst['ratio']:.2f}x, "
                    f"fastest peer {best_peer['variant']} {best_peer['ratio']:.2f}x",
                    "yes" if ok else "**no**",
                )
            )
    first = [r for r in rows if r["compile_cpu_s"] is not None]
    for case in cases:
        plain = next((r for r in first if r["case"] == case and r["variant"] == "plain"), None)
        if plain is None:
            continue
        for r in first:
            if r["case"] == case and r["variant"].startswith("lsj_"):
                ratio = r["compile_cpu_s"] / plain["compile_cpu_s"]
                out.append(
                    (
                        f"compile <= 2x plain: {r['variant']}, {case.split('/')[0]} {r['kind']}",
                        f"{ratio:.2f}x ({r['compile_cpu_s']:.2f} vs {plain['compile_cpu_s']:.2f} "
                        "CPU s)",
                        "yes" if ratio <= 2.0 else "**no**",
                    )
                )
        for r in first:
            if r["case"] == case and r["variant"].startswith("lsj_"):
                extra = (r["temp_bytes"] - plain["temp_bytes"]) / r["params"]
                out.append(
                    (
                        f"temporaries <= plain + 1 B/param: {r['variant']}, "
                        f"{case.split('/')[0]} {r['kind']}",
                        f"{extra:+.2f} B/param",
                        "yes" if extra <= 1.0 else "**no**",
                    )
                )
    return out


def _mb(b):
    return "" if b is None else f"{b / 2**20:.1f}"


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "<!-- Generated by benchmarks/bench_step.py; do not edit by hand. -->",
        "# Benchmark results",
        "",
        f"Command: `{meta['command'].strip()}`  ",
        f"Machine: {meta['machine']}; jax {meta['jax']}, optax {meta['optax']}; "
        f"load average before / after: {meta['load_before']} / {meta['load_after']}; "
        f"wall time {meta['wall_s']:.0f} s; {meta['rounds']} rounds x {meta['iters']} steps "
        f"per variant; allocators: {', '.join(meta['allocators'])}"
        + (f" (not installed: {', '.join(meta['missing'])})" if meta.get("missing") else "")
        + ".",
        "",
        "`x plain`: the median over rounds of (variant median / plain median in that round), "
        "with the range over rounds. `compile`: CPU seconds of trace + lower + compile (first "
        "allocator only). `temp`: `memory_analysis()` temporaries. `moved`: bytes a good step "
        "reads and writes, estimated from the HLO, per parameter. `faults`: minor page faults "
        "per step.",
    ]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    allocs = list(dict.fromkeys(r["allocator"] for r in rows))
    for case in cases:
        first = next(r for r in rows if r["case"] == case)
        lines += [
            "",
            f"## {case} ({first['params'] / 1e6:.1f}M params, {first['leaves']} leaves)",
            "",
        ]
        lines.append(
            "| variant | "
            + " | ".join(f"x plain, {a}" for a in allocs)
            + " | ms, "
            + allocs[0]
            + " | faults/step | compile s | temp MB | moved B/param"
            " | kernels | cond | copies | selects |"
        )
        lines.append("|---|" + "---:|" * (len(allocs) + 9))
        for name in dict.fromkeys(r["variant"] for r in rows if r["case"] == case):
            cells, base = [], None
            for a in allocs:
                r = next(
                    (
                        r
                        for r in rows
                        if r["case"] == case and r["variant"] == name and r["allocator"] == a
                    ),
                    None,
                )
                if r is None:
                    cells.append("")
                    continue
                base = base or r
                cells.append(
                    f"REFUSED: {r['refused']}"
                    if r["refused"]
                    else f"{r['ratio']:.2f} ({r['ratio_lo']:.2f}-{r['ratio_hi']:.2f})"
                )
            comp = base["compile_cpu_s"]
            ms = "" if base["refused"] else f"{base['median_ms']:.2f}"
            lines.append(
                f"| {name} | "
                + " | ".join(cells)
                + f" | {ms} | {base['faults_per_step']:.0f} | "
                + ("" if comp is None else f"{comp:.2f}")
                + f" | {_mb(base['temp_bytes'])} | "
                f"{base['bytes_moved'] / base['params']:.1f} | {base['kernels']} | "
                f"{base['conditionals']} | {base['param_sized_copies']} | "
                f"{base['param_sized_selects']} |"
            )
    checks = targets(rows, allocs)
    if checks:
        lines += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]
        lines += [f"| {t} | {m} | {ok} |" for t, m, ok in checks]
    if meta.get("check_report"):
        lines += ["", "## The overflow check alone (ieee, float16 gradients)", ""]
        lines.append(check_table(meta["check_report"]))
    if meta.get("compile_report"):
        lines += ["", "## Where the compile time goes (CPU seconds, from scratch)", ""]
        lines.append(compile_table(meta["compile_report"]))
    return "\n".join(lines) + "\n"


DOCS = HERE.parent / "docs" / "performance.md"


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- bench_step.py: {name} begin -->", f"<!-- bench_step.py: {name} end -->"


def headline(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The headline tables docs/performance.md quotes, from the same rows as results.md."""
    cases = [c for c in HEADLINE if any(r["case"] == c for r in rows)]
    allocs = list(dict.fromkeys(r["allocator"] for r in rows))
    title = {"mlp_20m": "20M", "deep_300": "300 leaves"}
    lines = [
        f"Quoted from `benchmarks/results.md` (written by the same run): "
        f"`{meta['command'].strip()}`, {meta['machine']}, load average before / after "
        f"{meta['load_before']} / {meta['load_after']}, {meta['rounds']} rounds x "
        f"{meta['iters']} steps. Ratios to the plain step, median over rounds (range).",
    ]
    for a in allocs:
        lines += [
            "",
            f"Allocator `{a}`:",
            "",
            "| variant | "
            + " | ".join(
                f"{title.get(c.split('/')[0], c.split('/')[0])} {c.split('/')[-1]}" for c in cases
            )
            + " |",
            "|---|" + "---:|" * len(cases),
        ]
        for name in dict.fromkeys(r["variant"] for r in rows if r["case"] in cases):
            cells = []
            for c in cases:
                r = next(
                    (r for r in rows if (r["allocator"], r["case"], r["variant"]) == (a, c, name)),
                    None,
                )
                cells.append(
                    ""
                    if r is None
                    else "refused"
                    if r["refused"]
                    else f"{r['ratio']:.2f} ({r['ratio_lo']:.2f}-{r['ratio_hi']:.2f})"
                )
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    checks = targets(rows, allocs)
    if checks:
        lines += ["", "| target | measured | met |", "|---|---|---|"]
        lines += [f"| {t} | {m} | {ok} |" for t, m, ok in checks]
    return "\n".join(lines)


def check_table(report: list[dict[str, Any]] | None) -> str:
    if not report:
        return ""
    lines = [
        "| workload | formulation | median ms | x grouped | compile s | temp B/param "
        "| moved B/param | kernels |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report:
        lines.append(
            f"| {r['workload']} | {r['check']} | {r['median_ms']:.2f} | "
            f"{r['x_grouped']:.2f} | {r['compile_cpu_s']:.2f} | "
            f"{r['temp_bytes_per_param']:.2f} | {r['bytes_moved_per_param']:.1f} | "
            f"{r['kernels']} |"
        )
    return "\n".join(lines)


def update_docs(rows: list[dict[str, Any]], meta: dict[str, Any], path: Path = DOCS) -> list[str]:
    """Rewrites the marked blocks of docs/performance.md; returns the blocks rewritten."""
    if not path.exists():
        return []
    text, done = path.read_text(), []
    blocks = {"headline": headline(rows, meta)}
    if meta.get("check_report"):
        blocks["check"] = (
            f"Quoted from `benchmarks/results.md` (same run as above, {max(meta['rounds'], 5)} "
            "interleaved calls each):\n\n" + check_table(meta["check_report"])
        )
    if meta.get("compile_report"):
        blocks["compile"] = (
            "Quoted from `benchmarks/results.md` (same run as above):\n\n"
            + compile_table(meta["compile_report"])
        )
    for name, body in blocks.items():
        begin, end = _markers(name)
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            _, tail = rest.split(end, 1)
            text = head + begin + "\n" + body + "\n" + end + tail
            done.append(name)
    path.write_text(text)
    return done


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


SLOW_PEERS = ("jmp", "flax")


def run_here(
    cases, variants, rounds, iters, measure_compile, allocator, skip_slow_peers=False
) -> list[dict[str, Any]]:
    jax.jit(lambda a: a * 2 + 1).lower(jnp.ones(3)).compile()  # JAX's one-time costs
    rows = []
    for case in cases:
        _log(f"{case} [{allocator}]")
        names = variants
        if skip_slow_peers and WORKLOADS[case.split("/")[0]].get("depth", 0) >= 100:
            names = [v for v in variants if v not in SLOW_PEERS]
        for r in run_case(case, names, rounds, iters, measure_compile, _log):
            r["allocator"] = allocator
            flag = f"REFUSED: {r['refused']}" if r["refused"] else ""
            _log(
                f"    {r['variant']:24s} x{r['ratio']:.2f} ({r['ratio_lo']:.2f}-"
                f"{r['ratio_hi']:.2f})  {r['median_ms']:8.2f} ms  "
                f"faults {r['faults_per_step']:7.0f}"
                f"  temp {_mb(r['temp_bytes'])} MB {flag}"
            )
            rows.append(r)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny cases, in-process (smoke run)")
    ap.add_argument("--cases", nargs="*", default=None, help="workload/layout/pattern/step")
    ap.add_argument("--variants", nargs="*", default=None)
    ap.add_argument("--allocators", nargs="*", default=None, choices=ALLOCATORS)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None, help="steps per variant per round")
    ap.add_argument(
        "--check-report",
        action="store_true",
        help="time the check formulations and take the compile time apart (default run: on)",
    )
    ap.add_argument("--out", default=str(HERE), help="folder for results.json and results.md")
    ap.add_argument(
        "--render",
        action="store_true",
        help="rewrite results.md and the docs blocks from results.json (no measuring)",
    )
    ap.add_argument(
        "--skip-slow-peers",
        action="store_true",
        help="leave jmp and Flax out of the 300-leaf cases (their compiles take minutes each)",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # JSON file to write
    ap.add_argument("--no-compile-times", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    cases = args.cases or list(QUICK_CASES if args.quick else DEFAULT_CASES)
    for case in cases:
        parts = case.split("/")
        if (
            len(parts) != 4
            or parts[0] not in WORKLOADS
            or parts[1] not in LAYOUTS
            or parts[2] not in PATTERNS
            or parts[3] not in KINDS
        ):
            raise ValueError(
                f"--cases: {case!r} is not workload/layout/pattern/step with "
                f"workload in {list(WORKLOADS)}, layout in {LAYOUTS}, pattern in "
                f"{PATTERNS}, step in {KINDS}."
            )
    names = args.variants or list(DEFAULT_VARIANTS)
    for name in names:
        if name not in VARIANTS:
            raise ValueError(f"--variants: unknown variant {name!r}; choose from {list(VARIANTS)}.")
    variants = ["plain"] + [v for v in names if v != "plain"]
    rounds = args.rounds or (2 if args.quick else 7)
    iters = args.iters or (2 if args.quick else 3)

    if args.render:
        saved = json.loads((Path(args.out) / "results.json").read_text())
        (Path(args.out) / "results.md").write_text(markdown(saved["rows"], saved["meta"]))
        if Path(args.out).resolve() == HERE:
            _log(f"updated {DOCS}: {update_docs(saved['rows'], saved['meta'])}")
        return saved["rows"]

    if args.child:  # one allocator, in this process, rows to a file
        rows = run_here(
            cases,
            variants,
            rounds,
            iters,
            not args.no_compile_times,
            os.environ.get("BENCH_ALLOCATOR", "default"),
            args.skip_slow_peers,
        )
        Path(args.child).write_text(json.dumps(rows))
        return rows

    t_start, load_before = time.perf_counter(), _load()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = args.allocators or (["default"] if args.quick else list(DEFAULT_ALLOCATORS))
    allocators = [a for a in wanted if allocator_env(a) is not None]
    missing = [a for a in wanted if a not in allocators]
    rows: list[dict[str, Any]] = []
    if args.quick and allocators == ["default"]:
        # A smoke run: no compile times (they would need every cache cleared).
        rows = run_here(cases, variants, rounds, iters, False, "default")
    else:
        cache = tempfile.mkdtemp(prefix="bench_step_cache_")
        try:
            for i, alloc in enumerate(allocators):
                result = Path(cache) / f"rows_{alloc}.json"
                env = {
                    **os.environ,
                    **allocator_env(alloc),
                    "BENCH_ALLOCATOR": alloc,
                    "JAX_COMPILATION_CACHE_DIR": cache,
                    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
                }
                cmd = [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--child",
                    str(result),
                    "--cases",
                    *cases,
                    "--variants",
                    *variants,
                    "--rounds",
                    str(rounds),
                    "--iters",
                    str(iters),
                ]
                if i > 0:
                    cmd.append("--no-compile-times")
                if args.skip_slow_peers:
                    cmd.append("--skip-slow-peers")
                settings = " ".join(f"{k}={v}" for k, v in allocator_env(alloc).items())
                _log(f"== allocator {alloc}: {settings or '(glibc defaults)'}")
                subprocess.run(cmd, env=env, check=True)
                rows += json.loads(result.read_text())
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    default_run = not (args.quick or args.cases or args.variants or args.skip_slow_peers)
    report = check_report(max(rounds, 5), _log) if (args.check_report or default_run) else None
    compiles = compile_report("deep_300", _log) if (args.check_report or default_run) else None
    meta = {
        "command": " ".join(
            ["python benchmarks/bench_step.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {jax.devices()[0].platform}",
        "jax": jax.__version__,
        "optax": optax.__version__,
        "load_before": load_before,
        "load_after": _load(),
        "wall_s": time.perf_counter() - t_start,
        "rounds": rounds,
        "iters": iters,
        "allocators": allocators,
        "missing": missing,
        "check_report": report,
        "compile_report": compiles,
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "results.md").write_text(markdown(rows, meta))
    if not args.quick and out.resolve() == HERE and set(HEADLINE) <= set(cases):
        _log(f"updated {DOCS}: {update_docs(rows, meta)}")
    _log("\nTarget by target:")
    for t, m, ok in targets(rows, allocators):
        _log(f"  [{ok.strip('*'):7s}] {t}: {m}")
    refused = [r for r in rows if r["refused"]]
    for r in refused:
        _log(f"  REFUSED {r['allocator']} {r['case']} {r['variant']}: {r['refused']}")
    _log(
        f"wrote {out / 'results.json'} and {out / 'results.md'} "
        f"({time.perf_counter() - t_start:.0f} s)"
    )
    return rows


if __name__ == "__main__":
    main()
