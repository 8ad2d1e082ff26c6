"""The layer map of per-layer scaling: ``LayerMap``, ``discover``, and what reads a state by it.

``discover`` finds a model's layer taps and each parameter leaf's segment (``_segments``);
``factors``, ``value_and_grad`` and ``layer_metrics`` read a ``LayerwiseScalingState`` by
the map.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from lossscale_jax.engine._opt_states import LayerwiseScalingState
from lossscale_jax.engine._tap_stats import TapStats
from lossscale_jax.errors import TapError
from lossscale_jax.layerwise._segments import segments_of
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
    state = layer_state(opt_state)
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


def layer_state(opt_state: Any) -> LayerwiseScalingState:
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


def layer_metrics(opt_state: Any, layers: LayerMap) -> dict[str, dict[str, jax.Array]]:
    """Per layer tap (and ``"loss"``): its segment's cumulative scale, the factor its tap
    applies, and the overflows attributed to it (arrays; no host sync)."""
    state = layer_state(opt_state)
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
