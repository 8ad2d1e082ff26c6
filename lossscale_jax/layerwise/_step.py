"""The per-layer step, stage by stage: check, decide per segment, unscale, apply or skip.

``LayerwiseStep`` holds what ``layerwise_scaling`` validated (its engine, the inner
transformation, the ``HeadroomScale`` rule, the ``LayerMap``, ``every_k``) and runs the
stages; the factory wraps its ``init``, ``update`` and ``fused`` as an Optax transformation.
The check, the collective, ``on_stuck`` and the skip are the engine's
(``Engine.check_layers``, ``fold``, ``select``; ``inner_or_skip``): this module adds only the
segments, their scales and the per-leaf unscale.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from lossscale_jax.engine import _stuck
from lossscale_jax.engine._engine import (
    Check,
    Engine,
    check_state,
)
from lossscale_jax.engine._inner_skip import inner_or_skip, skip_updates
from lossscale_jax.engine._landing import land_first, unscale_targets, warn_float16_inner
from lossscale_jax.engine._nesting import refuse_nested_state
from lossscale_jax.engine._ops import where
from lossscale_jax.engine._opt_states import LayerScales, LayerWindow, LayerwiseScalingState
from lossscale_jax.engine._state import (
    LossScaleState,
    initial_state,
    record_step,
    unlanded_step,
)
from lossscale_jax.engine._unscale import inverse, unscale_leaf
from lossscale_jax.engine._window import acc_zeros, add_good, cleared, mean_of
from lossscale_jax.layerwise._map import LayerMap
from lossscale_jax.policies import HeadroomScale


def _segment_states(layers: LayerScales) -> LossScaleState:
    """The segments as one ``LossScaleState`` batched over its leading axis."""
    base = jax.vmap(initial_state)(layers.scale)
    return base.replace(
        range_peak=layers.range_peak, margin=layers.margin, growth_count=layers.growth_count
    )


@dataclasses.dataclass(frozen=True)
class LayerwiseStep:
    """One ``layerwise_scaling``'s validated configuration and the stages of its step."""

    engine: Engine
    inner: optax.GradientTransformationExtraArgs
    policy: HeadroomScale
    layers: LayerMap
    every_k: int

    @property
    def n(self) -> int:
        """The number of layer taps (segments ``0..n``, ``n`` the loss's)."""
        return len(self.layers.names)

    def empty_window(self, acc: Any, record: jax.Array | None) -> LayerWindow:
        n = self.n
        return LayerWindow(
            mini_step=jnp.zeros([], jnp.int32),
            overflow=jnp.zeros([], jnp.bool_),
            segments=jnp.zeros([n + 1], jnp.bool_),
            amax=jnp.zeros([n + 1], jnp.float32),
            acc_grads=jax.tree_util.tree_map(jnp.zeros_like, acc),
            leaf_overflow=record,
        )

    def init(self, params: optax.Params) -> LayerwiseScalingState:
        n, engine = self.n, self.engine
        inner_state = self.inner.init(params)
        refuse_nested_state(inner_state, "layerwise_scaling")
        warn_float16_inner(params, inner_state, "layerwise_scaling")
        one = self.policy.init()
        seg = LayerScales(
            scale=jnp.full([n + 1], one.scale, jnp.float32),
            range_peak=jnp.zeros([n + 1], jnp.float32),
            margin=jnp.full([n + 1], one.margin, jnp.int32),
            growth_count=jnp.zeros([n + 1], jnp.int32),
            overflow_steps=jnp.zeros([n + 1], jnp.int32),
        )
        window = None
        if self.every_k > 1:
            acc = jax.tree_util.tree_map(acc_zeros, params)
            window = self.empty_window(acc, engine.empty_record(params))
        return LayerwiseScalingState(one, seg, inner_state, engine.empty_record(params), window)

    def decide(
        self, state: LayerwiseScalingState, check: Any, when: jax.Array | None = None
    ) -> tuple[Any, Any, jax.Array]:
        """HeadroomScale's rule per segment; the backoff to the culprit nearest the loss."""
        n, policy = self.n, self.policy
        overflow = check.overflow
        index = jnp.arange(n + 1)
        flagged = where(check.segments, index, -1)
        culprit = where(jnp.any(check.segments), jnp.max(flagged), n)
        segs = _segment_states(state.layers)
        bad = jax.vmap(lambda s: policy.adjust(s, True, jnp.float32(jnp.inf)))(segs)
        good = jax.vmap(policy.adjust)(segs, jnp.zeros([n + 1], bool), check.amax)
        hit = jnp.logical_and(overflow, index == culprit)

        def pick(b: jax.Array, g: jax.Array, old: jax.Array) -> jax.Array:
            return where(hit, b, where(overflow, old, g))

        new = LayerScales(
            scale=pick(bad.scale, good.scale, state.layers.scale),
            range_peak=pick(bad.range_peak, good.range_peak, state.layers.range_peak),
            margin=pick(bad.margin, good.margin, state.layers.margin),
            growth_count=pick(bad.growth_count, good.growth_count, state.layers.growth_count),
            overflow_steps=where(
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
        loss_scale, unlanded = unlanded_step(state.loss_scale, loss_scale, overflow, check.unlanded)
        if unlanded is not None:  # an update that cannot land: no segment's scale moves
            new = jax.tree_util.tree_map(
                lambda old, moved: where(unlanded, old, moved), state.layers, new
            )
        # outside the skip (Engine.decide)
        _stuck.check_stuck(loss_scale, self.engine.on_stuck, when, unlanded, check.float16_leaves)
        return loss_scale, new, jnp.logical_not(loss_scale.last_skipped)

    def unscale(self, grads: Any, scales: jax.Array, params: Any) -> Any:
        """Each leaf divided by its own segment's scale."""
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        ps = jax.tree_util.tree_leaves(params) if params is not None else [None] * len(leaves)
        inv = [inverse(scales[s]) for s in range(self.n + 1)]
        out = [
            unscale_leaf(g, inv[self.layers.segments[i]], p)
            for i, (g, p) in enumerate(zip(leaves, ps, strict=True))
        ]
        return jax.tree_util.tree_unflatten(treedef, out)

    def step(self, grads: Any, state: Any, params: Any, extra_args: dict, fused: bool) -> Any:
        """One step without accumulation: the Optax path's update, or the fused step's."""
        engine, inner = self.engine, self.inner
        state = check_state(state, LayerwiseScalingState, "layerwise_scaling")
        taps = extra_args.pop("taps", None)
        scales = state.layers.scale
        check = engine.check_layers(grads, scales, self.layers, taps, state.loss_scale.scale)
        targets = unscale_targets(params, state.inner_state)

        def inner_update(g: Any, inner_state: Any, p: Any = params) -> Any:
            return inner.update(self.unscale(g, scales, targets), inner_state, p, **extra_args)

        # float16 parameters: the update is computed first, and where it lands is checked
        # (an update that cannot land is skipped, every segment's scale kept).
        check, landed = land_first(
            engine, check, params, inner_update, grads, state.inner_state, scales[-1]
        )
        loss_scale, new_layers, apply = self.decide(state, check)

        def good(operands: Any) -> Any:
            g, inner_state, p = operands
            updates, inner_state = landed(g, inner_state, p)
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

    def window_step(self, grads: Any, state: Any, params: Any, extra_args: dict) -> Any:
        """Accumulation: as ``loss_scaling_multi_steps``, per segment. The scales are constant
        within a window; each micro-batch is checked (one all-reduce) and folded."""
        engine, inner, every_k = self.engine, self.inner, self.every_k
        state = check_state(state, LayerwiseScalingState, "layerwise_scaling")
        taps = extra_args.pop("taps", None)
        scales, win = state.layers.scale, state.window
        this = engine.check_layers(grads, scales, self.layers, taps, state.loss_scale.scale)
        so_far = Check(win.overflow, win.leaf_overflow, win.amax, win.segments)
        window = engine.fold(so_far, this)
        unscaled = self.unscale(grads, scales, unscale_targets(params, state.inner_state))
        acc = add_good(win.acc_grads, unscaled, this.overflow)

        def inner_update(g: Any, inner_state: Any) -> Any:
            return inner.update(g, inner_state, params, **extra_args)

        shapes = jax.eval_shape(inner_update, mean_of(acc, unscaled, every_k), state.inner_state)
        at_end = win.mini_step >= every_k - 1
        mean = mean_of(acc, unscaled, every_k)
        decided, inner_update = land_first(
            engine, window, params, inner_update, mean, state.inner_state, scales[-1], at_end
        )
        loss_scale, new_layers, apply = self.decide(state, decided, when=at_end)

        def finish(acc_tree: Any) -> Any:
            mean = mean_of(acc_tree, unscaled, every_k)
            updates, inner_state = inner_or_skip(
                engine, apply, inner_update, mean, state.inner_state, shapes
            )
            fresh = self.empty_window(acc_tree, cleared(window.flags))
            return updates, LayerwiseScalingState(
                loss_scale, new_layers, inner_state, decided.flags, fresh
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

    def update(
        self, updates: optax.Updates, state: Any, params: optax.Params | None = None, **extra: Any
    ) -> tuple[optax.Updates, LayerwiseScalingState]:
        """The Optax path's ``update``: a window's micro-batch, or a whole step."""
        if self.every_k > 1:
            return self.window_step(updates, state, params, extra)
        return self.step(updates, state, params, extra, fused=False)

    def fused(self, grads: Any, state: Any, params: Any, **extra: Any) -> Any:
        """The fused step (``apply_gradients``): the parameter update inside the good branch."""
        return self.step(grads, state, params, extra, fused=True)
