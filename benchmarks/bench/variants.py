"""The steps the benchmark times: the plain step, lossscale_jax's, and the JAX peers'.

Each variant is ``variant(loss, pattern) -> (full, post, init, scale_of)``:

- ``full(params, state, x, y) -> (params, state, loss)``: forward, backward, the step;
- ``post(params, state, grads) -> (params, state)``: the step on precomputed scaled gradients;
- ``init(params) -> state``;
- ``scale_of(state) -> (loss scale, steps skipped so far)`` as host numbers, or None (plain).

``plain`` is what a user runs without loss scaling (gradients cast to the parameter dtype, then
``optax.adam`` and ``apply_updates``); ``lsj_optax_*`` is ``tx.update`` + ``apply_updates``,
``lsj_fused_*`` is ``lsj.apply_gradients``; ``jmp``, ``flax`` and ``optax_if_finite`` are the
peers as their documentation has them. Not in the default run: the ``lsj_*_headroom_ieee``
steps, ``lsj_headroom_taps``, ``lsj_*_select_ieee`` and ``lsj_*_cond_ieee`` (the skip's
formulation forced), ``plain_scaled`` (plain with a constant loss scale), ``where_skip`` (a
bare ``jnp.where`` skip: the floor of a select formulation) and the prototypes
(``prototypes.PROTOTYPES``).

``GPU_VARIANTS`` names the variants of the GPU results (``--gpu-results``); ``missing_package``
says which variant cannot run here (jmp is an optional dependency).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

import lossscale_jax as lsj

from ._library import skip_formulation
from .prototypes import PROTOTYPES
from .workloads import F32, INIT_SCALE, LR, cast_like, to16, value_and_grads


def _full_step(loss, pattern, post, scale_in: Callable) -> Callable:
    """The full step: forward and backward (the loss scaled by ``scale_in(state)``, None for
    no scaling), then ``post`` on the gradients."""

    def full(params, state, x, y):
        value, grads = value_and_grads(loss, params, x, y, pattern, scale_in(state))
        return (*post(params, state, grads), value)

    return full


def variant_plain(loss, pattern):
    adam = optax.adam(LR)

    def post(params, state, grads):
        updates, state = adam.update(cast_like(grads, params), state, params)
        return optax.apply_updates(params, updates), state

    return _full_step(loss, pattern, post, lambda s: None), post, adam.init, lambda s: None


def variant_plain_scaled(loss, pattern):
    """The least a scaled step does: the loss times the constant ``INIT_SCALE``, the gradients
    times its inverse as they are cast (exact: a power of two), then plain's Adam; no check, no
    skip, no state. Beside plain, it tells what the scaled backward pass costs by itself:
    plain's float16 backward pass loses most of the logits' gradient to underflow (zeros), a
    scaled one computes on the values (docs/performance.md, "On a GPU")."""
    adam = optax.adam(LR)
    inverse = 1.0 / INIT_SCALE

    def post(params, state, grads):
        grads = jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype) * inverse, grads, params)
        updates, state = adam.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def scale_in(state):
        return jnp.float32(INIT_SCALE)

    return _full_step(loss, pattern, post, scale_in), post, adam.init, lambda s: None


def variant_where_skip(loss, pattern):
    """The least a select skip costs: a bare ``jnp.where`` skip on a static scale, no policy,
    counters or record. The gradients unscaled as they are cast, ``all(isfinite)`` per leaf
    and over the leaves, Adam, then each update ``where(finite, u, -0.0)`` and each moment
    ``where(finite, new, old)``. It is the floor a select formulation of the skip sits on
    (docs/performance.md, "On a GPU"); the scale never moves, so nothing is adjusted."""
    adam = optax.adam(LR)
    inverse = 1.0 / INIT_SCALE

    def post(params, state, grads):
        finite = jnp.all(
            jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree_util.tree_leaves(grads)])
        )
        grads = jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype) * inverse, grads, params)
        updates, new_state = adam.update(grads, state, params)
        updates = jax.tree_util.tree_map(lambda u: jnp.where(finite, u, -0.0), updates)
        state = jax.tree_util.tree_map(
            lambda new, old: jnp.where(finite, new, old), new_state, state
        )
        return optax.apply_updates(params, updates), state

    def scale_in(state):
        return jnp.float32(INIT_SCALE)

    return _full_step(loss, pattern, post, scale_in), post, adam.init, lambda s: None


def lsj_scale_of(state):
    m = lsj.metrics(state)
    return float(m["loss_scale"]), int(m["skipped_steps"])


def headroom_pinned() -> lsj.LossScalePolicy:
    """``HeadroomScale`` held at ``INIT_SCALE`` (min = max): the whole rule runs (the range in
    the check, the packed reduction, the target) and the scale stays put, so the timed steps
    are comparable with the others."""
    return lsj.HeadroomScale(init_scale=INIT_SCALE, min_scale=INIT_SCALE, max_scale=INIT_SCALE)


def variant_lsj(loss, pattern, *, fused: bool, mode: str, step=None, policy=None, formulation=None):
    """lossscale_jax's step; ``step(tx, grads, state, params)`` replaces it (a prototype's
    structure), ``policy()`` replaces ``DynamicScale``, ``formulation`` (``"cond"`` or
    ``"select"``) replaces the skip's formulation the backend would get (``_skip.py``)."""
    policy = lsj.DynamicScale(init_scale=INIT_SCALE) if policy is None else policy()
    tx = lsj.loss_scaling(optax.adam(LR), policy, overflow=mode)

    def library_post(params, state, grads):
        if step is not None:
            return step(tx, grads, state, params)
        if fused:
            return lsj.apply_gradients(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def post(params, state, grads):
        if formulation is None:
            return library_post(params, state, grads)
        with skip_formulation(formulation):  # read while the step is traced
            return library_post(params, state, grads)

    def scale_in(state):
        return lsj.get_loss_scale_state(state).scale

    return _full_step(loss, pattern, post, scale_in), post, tx.init, lsj_scale_of


def variant_headroom_taps(loss, pattern):
    """The fused step with ``HeadroomScale`` (held at ``INIT_SCALE``) fed the taps of the
    backward pass: the full step differentiates with ``lsj.taps.value_and_grad`` (every
    ``lsj.tap`` of the workload, one per layer or block, and the loss, tapped by
    ``lsj.scale_loss``) and passes them to ``apply_gradients``, whose check and range then
    cover the activation gradients too.

    A post step runs no backward pass, so it has no taps to read: its post step is
    ``HeadroomScale`` on the given gradients alone (what ``lsj_fused_headroom_ieee`` times);
    the taps' cost is in the full step."""
    tx = lsj.loss_scaling(optax.adam(LR), headroom_pinned(), overflow="ieee")

    def full(params, state, x, y):
        def scaled(p):
            value = loss(to16(p) if pattern == "fp32grad" else p, x, y)
            return lsj.scale_loss(value, state), value

        target = params if pattern == "fp32grad" else to16(params)
        (_, value), grads, taps = lsj.taps.value_and_grad(scaled, has_aux=True)(target)
        return (*lsj.apply_gradients(tx, grads, state, params, taps=taps), value)

    def post(params, state, grads):
        return lsj.apply_gradients(tx, grads, state, params)

    return full, post, tx.init, lsj_scale_of


def variant_layerwise(loss, pattern):
    """``lsj.layerwise_scaling`` (one scale per layer tap of the workload), fused, its
    ``HeadroomScale`` pinned at ``INIT_SCALE`` in every segment (every tap's factor is 1):
    the whole per-layer rule runs and no scale moves. A full step only: its update takes
    the taps of the backward pass, which a post step on precomputed gradients has not."""
    holder: dict = {}

    def init(params):
        target = params if pattern == "fp32grad" else to16(params)
        layers = lsj.layerwise.discover(
            lambda p, x, y: loss(to16(p), x, y), target, *loss.example_batch
        )
        tx = lsj.layerwise_scaling(optax.adam(LR), layers, headroom_pinned())
        holder.update(layers=layers, tx=tx)
        return tx.init(params)

    def full(params, state, x, y):
        layers, tx = holder["layers"], holder["tx"]

        def scaled(p):
            value = loss(to16(p), x, y)
            return lsj.scale_loss(value, state), value

        target = params if pattern == "fp32grad" else to16(params)
        (_, value), grads, taps = lsj.layerwise.value_and_grad(scaled, layers, state, has_aux=True)(
            target
        )
        return (*lsj.apply_gradients(tx, grads, state, params, taps=taps), value)

    def post(params, state, grads):
        raise ValueError("lsj_layerwise times full steps only (its update takes the taps).")

    return full, post, init, lsj_scale_of


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

    def scale_of(state):
        # jmp keeps no skip count; a skip lowers the scale, which is checked.
        return float(state[1][0]), 0

    return _full_step(loss, pattern, post, lambda s: s[1][0]), post, init, scale_of


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

    def scale_of(state):
        return INIT_SCALE, int(state.total_notfinite)

    return _full_step(loss, pattern, post, lambda s: scale), post, tx.init, scale_of


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
# Not in the default run: the prototypes, then HeadroomScale (the range measured in the
# check's reductions) held at the benchmark's scale.
VARIANTS |= {name: functools.partial(variant_lsj, **kw) for name, (_, kw) in PROTOTYPES.items()}
VARIANTS |= {
    "lsj_fused_headroom_ieee": functools.partial(
        variant_lsj, fused=True, mode="ieee", policy=headroom_pinned
    ),
    "lsj_optax_headroom_ieee": functools.partial(
        variant_lsj, fused=False, mode="ieee", policy=headroom_pinned
    ),
    "lsj_layerwise": variant_layerwise,
    "lsj_headroom_taps": variant_headroom_taps,
    # The skip's two formulations forced, whatever the backend takes (lossscale_jax/engine/_skip.py:
    # a select per leaf on XLA:GPU, a lax.cond elsewhere): one measured against the other.
    "lsj_optax_select_ieee": functools.partial(
        variant_lsj, fused=False, mode="ieee", formulation="select"
    ),
    "lsj_fused_select_ieee": functools.partial(
        variant_lsj, fused=True, mode="ieee", formulation="select"
    ),
    "lsj_optax_cond_ieee": functools.partial(
        variant_lsj, fused=False, mode="ieee", formulation="cond"
    ),
    "lsj_fused_cond_ieee": functools.partial(
        variant_lsj, fused=True, mode="ieee", formulation="cond"
    ),
    "plain_scaled": variant_plain_scaled,
    "where_skip": variant_where_skip,
}

# The GPU results' variant names (``--gpu-results``, results_gpu.json) and the variants they
# run: DynamicScale with the ieee check for the library's two paths; the conditional forced
# (``*_cond``) where asked for (``--variants``), the others by default (``GPU_DEFAULT``).
GPU_VARIANTS = {
    "plain": "plain",
    "plain_scaled": "plain_scaled",
    "lsj_optax": "lsj_optax_ieee",
    "lsj_fused": "lsj_fused_ieee",
    "lsj_headroom_taps": "lsj_headroom_taps",
    "jmp": "jmp",
    "flax": "flax",
    "optax_if_finite": "optax_if_finite",
    "where_skip": "where_skip",
    "lsj_optax_cond": "lsj_optax_cond_ieee",
    "lsj_fused_cond": "lsj_fused_cond_ieee",
}
GPU_DEFAULT = tuple(n for n in GPU_VARIANTS if not n.endswith("_cond"))
# The package a variant imports beyond lossscale_jax's own dependencies.
PACKAGES = {"jmp": "jmp", "flax": "flax"}


def missing_package(name: str) -> str | None:
    """The package variant ``name`` needs and this Python lacks, else None."""
    package = PACKAGES.get(name)
    if package is not None and importlib.util.find_spec(package) is None:
        return package
    return None


PEERS = ("jmp", "flax", "optax_if_finite")
SLOW_PEERS = ("jmp", "flax")  # their 300-leaf compiles take minutes (--skip-slow-peers)


def available(names: list[str]) -> tuple[list[str], dict[str, str]]:
    """The variants of ``names`` whose packages are installed, and the others with the
    package each lacks (``missing_package``)."""
    missing = {n: p for n in names if (p := missing_package(n)) is not None}
    return [n for n in names if n not in missing], missing
