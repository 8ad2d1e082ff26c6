"""Per-layer scaling's optimizer: the layer map, ``discover``, ``layerwise_scaling``.

Re-exported by ``lossscale_jax.layerwise`` (its docstring tells the whole story).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from lossscale_jax.engine import _check, _stuck
from lossscale_jax.engine._engine import (
    Check,
    Engine,
    EngineUpdate,
    check_state,
    inner_or_skip,
    skip_updates,
)
from lossscale_jax.engine._hyper import check_int
from lossscale_jax.engine._nesting import prepare_inner, refuse_nested_state
from lossscale_jax.engine._opt_states import LayerScales, LayerWindow, LayerwiseScalingState
from lossscale_jax.engine._state import LossScaleState, initial_state, record_step
from lossscale_jax.engine._tap_stats import TapStats
from lossscale_jax.engine._unscale import inverse, unscale_leaf
from lossscale_jax.engine._window import acc_zeros, add_good, cleared, mean_of
from lossscale_jax.errors import TapError
from lossscale_jax.layerwise._segments import segments_of
from lossscale_jax.policies import HeadroomScale
from lossscale_jax.taps import Modules
from lossscale_jax.taps import discover as discover_taps
from lossscale_jax.taps import value_and_grad as tapped_vg


@dataclasses.dataclass(frozen=True)
class LayerMap:
    """The layer taps of a model and the segment of each parameter leaf (static).

    Attributes:
      names: the layer taps, in forward order (module paths or ``lsj.tap`` names).
      segments: per leaf of the parameters (``tree_leaves`` order), the first layer tap
        its gradient passes on the way back from the loss (``len(names)``: none, the
        loss's segment).
      paths: the leaves' key paths.
      modules: the module selection the taps were found with (as ``lsj.taps.recording``).
    """

    names: tuple[str, ...]
    segments: tuple[int, ...]
    paths: tuple[str, ...]
    modules: Any = True

    def layer_of(self, path: str) -> str:
        """The layer (tap name, or ``"loss"``) whose scale a leaf's gradient has."""
        s = self.segments[self.paths.index(path)]
        return self.names[s] if s < len(self.names) else "loss"


def discover(
    loss_fn: Callable[..., Any], params: Any, *args: Any, modules: Modules = True
) -> LayerMap:
    """The layer map of ``loss_fn(params, *args)``: its taps (every Flax Linen module
    ``modules`` selects, every ``lsj.tap``) and, per parameter leaf, its segment.

    Traced once abstractly; nothing runs. A leaf whose gradient would pass different
    taps on different paths (tied weights, a tap on one branch of a residual), or taps
    that are not a chain, raise ``errors.TapError`` naming the leaf.
    """
    names = tuple(n for n in discover_taps(loss_fn, params, *args, modules=modules).names)
    if not names:
        raise TapError(
            "per-layer scaling found no layer tap in loss_fn: tap the layers (Flax modules "
            "are tapped by themselves; plain JAX: lsj.tap(x, name) at each layer's output)."
        )
    if "loss" in names:
        raise TapError(
            'discover takes the unscaled loss: a tap named "loss" (scale_loss\'s) is not a '
            "layer. Call it on the loss before lsj.scale_loss."
        )
    segments, paths = segments_of(loss_fn, params, args, names, modules)
    return LayerMap(names, segments, paths, modules)


def factors(layers: LayerMap, opt_state: Any) -> dict[str, jax.Array]:
    """Each layer tap's factor ``C_j / C_{j+1}`` from a per-layer state (exact: powers of 2)."""
    state = _layer_state(opt_state)
    c = state.layers.scale
    return {name: c[j] / c[j + 1] for j, name in enumerate(layers.names)}


def value_and_grad(
    fun: Callable[..., Any],
    layers: LayerMap,
    opt_state: Any,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any, TapStats]]:
    """``lsj.taps.value_and_grad`` with each layer tap scaling the backward signal by its
    factor from ``opt_state`` (a ``LayerwiseScalingState``): ``(value, grads, taps)``,
    ``grads`` per leaf at its segment's scale (``tx.update`` unscales each by its own)."""
    return tapped_vg(
        fun, argnums, has_aux, modules=layers.modules, factors=factors(layers, opt_state)
    )


def _layer_state(opt_state: Any) -> LayerwiseScalingState:
    if isinstance(opt_state, LayerwiseScalingState):
        return opt_state
    found = [
        x
        for x in jax.tree_util.tree_leaves(
            opt_state, is_leaf=lambda x: isinstance(x, LayerwiseScalingState)
        )
        if isinstance(x, LayerwiseScalingState)
    ]
    if len(found) != 1:
        raise TypeError(
            "opt_state must hold one LayerwiseScalingState (the state of "
            f"lsj.layerwise.layerwise_scaling), found {len(found)}."
        )
    return found[0]


def _segment_states(layers: LayerScales) -> LossScaleState:
    """The segments as one ``LossScaleState`` batched over its leading axis."""
    base = jax.vmap(initial_state)(layers.scale)
    return base.replace(
        range_peak=layers.range_peak, margin=layers.margin, growth_count=layers.growth_count
    )


def layerwise_scaling(
    inner: optax.GradientTransformation,
    layers: LayerMap,
    policy: HeadroomScale | None = None,
    *,
    overflow: _check.OverflowMode = "ieee",
    compute_dtype: Any = jnp.float16,
    axis_name: Any = None,
    local_axes: Any = None,
    on_stuck: str = "skip",
    attribution: str | None = "reduced",
    every_k: int = 1,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` with per-layer loss scaling: one scale per segment, one skip decision.

    Rule (one ``update``; ``C`` the segments' scales, ``n`` layer taps)::

      check = per-leaf flags and max |g|, each against its segment's C; each layer tap's
              range against the scale it was measured at (C[j + 1]) counts for segments
              j and j + 1, its inf/nan for segment j + 1; one all-reduce over axis_name
      overflow = any segment overflowed
      culprit = the overflowed segment closest to the loss (upstream ones inherit its inf)
      for each segment s:                          # HeadroomScale's rule, per segment
          if overflow and s == culprit: adjust(s, overflow=True)    # margin +1, scale down
          elif overflow:                keep s as it was
          else:                         adjust(s, overflow=False, amax=check.amax[s])
      loss_scale = record the step (scale C[n], skipped = overflow)
      if not overflow: updates = inner.update(g / C[segment of each leaf])
      else:            updates = -0.0, inner state unchanged

    Args:
      inner: any Optax transformation (it sees unscaled gradients).
      layers: the ``LayerMap`` of ``discover``.
      policy: the per-segment rule's hyperparameters, a ``HeadroomScale`` (default
        ``HeadroomScale()``); ``init_scale`` starts every segment.
      overflow, compute_dtype, axis_name, local_axes, on_stuck, attribution: as
        ``loss_scaling``.
      every_k: micro-batches per optimizer step (accumulation, as
        ``loss_scaling_multi_steps``: the scales are constant within a window, each
        micro-batch is checked and folded into the window's check, an overflowing one is
        left out of the sum, and the rule runs once at the window's end).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update`` takes ``taps=``
      (required: the ``TapStats`` of ``lsj.layerwise.value_and_grad``); ``apply_gradients``
      runs it fused.
    """
    if policy is None:
        policy = HeadroomScale()
    if not isinstance(policy, HeadroomScale):
        raise TypeError(
            "layerwise_scaling adapts each layer by HeadroomScale's rule: pass "
            f"policy=HeadroomScale(...), got {type(policy).__name__}."
        )
    if not isinstance(layers, LayerMap):
        raise TypeError(
            f"layers must be the LayerMap lsj.layerwise.discover returns, got {layers!r}."
        )
    engine = Engine.build(
        "layerwise_scaling",
        policy,
        overflow=overflow,
        compute_dtype=compute_dtype,
        axis_name=axis_name,
        local_axes=local_axes,
        on_stuck=on_stuck,
        attribution=attribution,
    )
    inner = prepare_inner(inner, "layerwise_scaling")
    every_k = check_int("every_k", every_k, 1)
    n = len(layers.names)

    def _empty_window(acc: Any, record: jax.Array | None) -> LayerWindow:
        return LayerWindow(
            mini_step=jnp.zeros([], jnp.int32),
            overflow=jnp.zeros([], jnp.bool_),
            segments=jnp.zeros([n + 1], jnp.bool_),
            amax=jnp.zeros([n + 1], jnp.float32),
            acc_grads=jax.tree_util.tree_map(jnp.zeros_like, acc),
            leaf_overflow=record,
        )

    def init_fn(params: optax.Params) -> LayerwiseScalingState:
        inner_state = inner.init(params)
        refuse_nested_state(inner_state, "layerwise_scaling")
        one = policy.init()
        seg = LayerScales(
            scale=jnp.full([n + 1], one.scale, jnp.float32),
            range_peak=jnp.zeros([n + 1], jnp.float32),
            margin=jnp.full([n + 1], one.margin, jnp.int32),
            growth_count=jnp.zeros([n + 1], jnp.int32),
            overflow_steps=jnp.zeros([n + 1], jnp.int32),
        )
        window = None
        if every_k > 1:
            acc = jax.tree_util.tree_map(acc_zeros, params)
            window = _empty_window(acc, engine.empty_record(params))
        return LayerwiseScalingState(one, seg, inner_state, engine.empty_record(params), window)

    def decide(
        state: LayerwiseScalingState, check: Any, when: jax.Array | None = None
    ) -> tuple[Any, Any, jax.Array]:
        overflow = check.overflow
        index = jnp.arange(n + 1)
        flagged = jnp.where(check.segments, index, -1)
        culprit = jnp.where(jnp.any(check.segments), jnp.max(flagged), n)
        segs = _segment_states(state.layers)
        bad = jax.vmap(lambda s: policy.adjust(s, True, jnp.float32(jnp.inf)))(segs)
        good = jax.vmap(policy.adjust)(segs, jnp.zeros([n + 1], bool), check.amax)
        hit = jnp.logical_and(overflow, index == culprit)

        def pick(b: jax.Array, g: jax.Array, old: jax.Array) -> jax.Array:
            return jnp.where(hit, b, jnp.where(overflow, old, g))

        new = LayerScales(
            scale=pick(bad.scale, good.scale, state.layers.scale),
            range_peak=pick(bad.range_peak, good.range_peak, state.layers.range_peak),
            margin=pick(bad.margin, good.margin, state.layers.margin),
            growth_count=pick(bad.growth_count, good.growth_count, state.layers.growth_count),
            overflow_steps=jnp.where(
                hit, state.layers.overflow_steps + 1, state.layers.overflow_steps
            ).astype(jnp.int32),
        )
        at_floor = state.layers.scale[culprit] <= jnp.float32(policy.min_scale)
        loss_scale = record_step(
            state.loss_scale,
            overflow,
            overflow,
            stuck=jnp.logical_and(overflow, at_floor),
            scale=new.scale[n],
            range_peak=new.range_peak[n],
            margin=new.margin[n],
            growth_count=new.growth_count[n],
            hysteresis_count=jnp.zeros([], jnp.int32),
        )
        _stuck.check_stuck(loss_scale, engine.on_stuck, when)  # outside the skip (Engine.decide)
        return loss_scale, new, jnp.logical_not(overflow)

    def unscale(grads: Any, scales: jax.Array, params: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        ps = jax.tree_util.tree_leaves(params) if params is not None else [None] * len(leaves)
        inv = [inverse(scales[s]) for s in range(n + 1)]
        out = [
            unscale_leaf(g, inv[layers.segments[i]], p)
            for i, (g, p) in enumerate(zip(leaves, ps, strict=True))
        ]
        return jax.tree_util.tree_unflatten(treedef, out)

    def step(grads: Any, state: Any, params: Any, extra_args: dict, fused: bool) -> Any:
        state = check_state(state, LayerwiseScalingState, "layerwise_scaling")
        taps = extra_args.pop("taps", None)
        scales = state.layers.scale
        check = engine.check_layers(grads, scales, layers, taps)
        loss_scale, new_layers, apply = decide(state, check)

        def good(operands: Any) -> Any:
            g, inner_state, p = operands
            updates, inner_state = inner.update(unscale(g, scales, p), inner_state, p, **extra_args)
            return (optax.apply_updates(p, updates) if fused else updates), inner_state

        operands = (grads, state.inner_state, params)
        shapes = None if fused else jax.eval_shape(good, operands)

        def skip(operands: Any) -> Any:
            _, inner_state, p = operands
            if shapes is None:  # the fused step: the parameters as they were
                return p, inner_state
            return skip_updates(shapes[0]), inner_state  # built inside the branch: free

        out, inner_state = engine.select(apply, good, skip, operands, good_shapes=shapes)
        return out, LayerwiseScalingState(loss_scale, new_layers, inner_state, check.flags)

    def window_step(grads: Any, state: Any, params: Any, extra_args: dict) -> Any:
        # Accumulation: as loss_scaling_multi_steps, per segment. The scales are constant
        # within a window; each micro-batch is checked (one all-reduce) and folded.
        state = check_state(state, LayerwiseScalingState, "layerwise_scaling")
        taps = extra_args.pop("taps", None)
        scales, win = state.layers.scale, state.window
        this = engine.check_layers(grads, scales, layers, taps)
        so_far = Check(win.overflow, win.leaf_overflow, win.amax, win.segments)
        window = engine.fold(so_far, this)
        unscaled = unscale(grads, scales, params)
        acc = add_good(win.acc_grads, unscaled, this.overflow)

        def inner_update(g: Any, inner_state: Any) -> Any:
            return inner.update(g, inner_state, params, **extra_args)

        shapes = jax.eval_shape(inner_update, mean_of(acc, unscaled, every_k), state.inner_state)
        at_end = win.mini_step >= every_k - 1
        loss_scale, new_layers, apply = decide(state, window, when=at_end)

        def finish(acc_tree: Any) -> Any:
            mean = mean_of(acc_tree, unscaled, every_k)
            updates, inner_state = inner_or_skip(
                engine, apply, inner_update, mean, state.inner_state, shapes
            )
            fresh = _empty_window(acc_tree, cleared(window.flags))
            return updates, LayerwiseScalingState(
                loss_scale, new_layers, inner_state, window.flags, fresh
            )

        def accumulate(acc_tree: Any) -> Any:
            kept = LayerWindow(
                (win.mini_step + 1).astype(jnp.int32),
                window.overflow,
                cast(jax.Array, window.segments),
                cast(jax.Array, window.amax),
                acc_tree,
                window.flags,
            )
            return skip_updates(shapes[0]), state._replace(window=kept)

        return engine.select(at_end, finish, accumulate, acc)

    def update_fn(
        updates: optax.Updates, state: Any, params: optax.Params | None = None, **extra: Any
    ) -> tuple[optax.Updates, LayerwiseScalingState]:
        if every_k > 1:
            return window_step(updates, state, params, extra)
        return step(updates, state, params, extra, fused=False)

    def fused_fn(grads: Any, state: Any, params: Any, **extra: Any) -> Any:
        return step(grads, state, params, extra, fused=True)

    fusable = every_k == 1  # with accumulation: the Optax path (tx.update), as multi-steps
    update = EngineUpdate(
        update_fn,
        engine,
        inner,
        fusable=fusable,
        fused_step=fused_fn if fusable else None,
        not_fusable_because=None
        if fusable
        else (
            f"lossscale_jax.apply_gradients does not take layerwise_scaling(..., "
            f"every_k={every_k}): with accumulation a call ends a window only every "
            f"{every_k} micro-batches, so there is no fused step to run. Use the Optax path: "
            "updates, opt_state = tx.update(grads, opt_state, params, taps=taps); params = "
            "optax.apply_updates(params, updates) (TrainState.apply_gradients does this)."
        ),
    )
    return optax.GradientTransformationExtraArgs(init_fn, update)  # pyright: ignore


def layer_metrics(opt_state: Any, layers: LayerMap) -> dict[str, dict[str, jax.Array]]:
    """Per layer tap (and ``"loss"``): its segment's cumulative scale, the factor its tap
    applies, and the overflows attributed to it (arrays; no host sync)."""
    state = _layer_state(opt_state)
    c = state.layers
    out = {}
    for j, name in enumerate((*layers.names, "loss")):
        out[name] = {
            "scale": c.scale[j],
            "factor": c.scale[j] / c.scale[j + 1] if j < len(layers.names) else c.scale[j],
            "overflow_steps": c.overflow_steps[j],
            "margin": c.margin[j],
        }
    return out
