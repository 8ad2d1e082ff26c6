"""Per-layer loss scaling: one scale per layer, where one global scale cannot serve the network.

A single loss scale has to fit every layer's gradients into float16's window at once. When the
layers' gradient magnitudes span more than that window, every global scale underflows the
smallest or overflows the largest. Here each layer tap multiplies the backward signal by a
power-of-two factor of its own, so each layer's gradients arrive scaled by the layer's own
cumulative scale; the unscale divides each leaf by its own. One overflow check and one skip
decision for the whole model (every device agrees), as with ``loss_scaling``.

::

  layers = lsj.layerwise.discover(loss_fn, params, batch)      # the layer taps, per leaf
  tx = lsj.layerwise.layerwise_scaling(optax.adam(1e-3), layers)
  opt_state = tx.init(params)
  # in the step:
  loss, grads, taps = lsj.layerwise.value_and_grad(scaled_loss, layers, opt_state)(params)
  params, opt_state = lsj.apply_gradients(tx, grads, opt_state, params, taps=taps)

The network is cut into segments at the layer taps (taps in forward order ``0..n-1``, then the
loss's segment ``n``): segment ``j`` is what the backward pass computes between tap ``j`` and the
tap before it, all of it at cumulative scale ``C_j``; the loss's segment runs at the loss scale
``C_n``. Tap ``j`` multiplies the signal by ``f_j = C_j / C_{j+1}``. Each segment adapts ``C_j``
by ``HeadroomScale``'s rule from its own range, and the overflow skip is the safety net.

Holds: ``_map`` (``LayerMap``, ``discover``, ``value_and_grad``, ``factors``,
``layer_metrics``), ``_segments`` (which layer taps each parameter's gradient passes: a jaxpr
walk), ``_step`` (``LayerwiseStep``: the per-layer step's stages: check, decide per segment,
unscale, apply or skip, the accumulation window) and ``_scaling`` (``layerwise_scaling``, the
factory that validates and wraps the step). The check, the collective and the skip are the
engine's (``Engine.check_layers``, ``fold``, ``select``); this folder adds the segments, their
scales and the per-leaf unscale.

May import: what lies below it in the package's order (``engine``, ``policies``, ``taps``,
``access``, the front-end modules) and ``errors``.
"""

from lossscale_jax.engine._opt_states import LayerScales, LayerWindow, LayerwiseScalingState

# factors (the tap multipliers of a layerwise optimizer state) stays importable here.
from lossscale_jax.layerwise._map import LayerMap, discover, layer_metrics, value_and_grad
from lossscale_jax.layerwise._map import factors as factors
from lossscale_jax.layerwise._scaling import layerwise_scaling

__all__ = [
    "LayerMap",
    "LayerScales",
    "LayerWindow",
    "LayerwiseScalingState",
    "discover",
    "layer_metrics",
    "layerwise_scaling",
    "value_and_grad",
]
