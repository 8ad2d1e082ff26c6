"""The wiring check: a step wired so that it would train silently wrong is refused.

A loss-scaled step is right when the gradients ``update`` divides by the scale are the
gradients of a loss multiplied by that same scale, once. Inside one traced step (``jit``,
``shard_map``, ``pmap``, a ``scan`` body: a *frame*, see ``_tracers``) the library sees both
ends: ``scale_loss`` notes here which scale it multiplied by and what it returned, and
``Engine.check`` asks, when ``update`` is traced with a traced scale:

- did ``scale_loss`` use this state's scale in this step, or do the gradients depend on it
  (a hand-written ``loss * scale``)? Then the step is wired right;
- else, did ``scale_loss`` multiply by a *constant* of the step while the policy moves the
  scale (the state read through a closure, not the step's argument)? ``WiringError``: the
  loss keeps the traced step's scale forever;
- else, were the gradients computed in this step by a backward pass? ``WiringError``:
  gradients of a loss that was never scaled, divided by the scale;
- else, did ``scale_loss`` use another state's scale of this step? ``WiringWarning`` (a
  window of micro-batches whose gradients were all taken before their updates is right);
- else the gradients came from outside the step (another ``jit``, an argument): nothing.

And ``scale_loss`` refuses a loss that already went through ``scale_loss`` in the same
differentiation (``WiringError``: every update too large by the scale).

What it cannot see: eager (un-jitted) calls, gradients computed in another ``jit`` or
passed in as arguments, a backward pass inside a loop body whose gradients leave it. A
policy whose scale is always 1 (``NoScale``, ``StaticScale(1.0)``) is not checked. Nothing
here changes a step's program: the check reads the trace and raises, or not.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale_jax.engine import _tracers
from lossscale_jax.errors import GradientDtypeError, WiringError, WiringWarning

_FIX = (
    "Take the gradients of lsj.scale_loss(loss, opt_state) with the optimizer state the "
    "step receives (the one given to update), or let lsj.value_and_grad(loss_fn, opt_state) "
    "do it."
)


@dataclasses.dataclass
class _Notes:
    """What ``scale_loss`` did in one frame (weak references: a note never keeps a frame's
    tracers alive)."""

    scales: list[weakref.ref] = dataclasses.field(default_factory=list)
    constants: list[Any] = dataclasses.field(default_factory=list)
    outputs: list[weakref.ref] = dataclasses.field(default_factory=list)


_FRAMES: weakref.WeakKeyDictionary[Any, _Notes] = weakref.WeakKeyDictionary()


def _live(refs: list[weakref.ref]) -> list[Any]:
    return [x for x in (r() for r in refs) if x is not None]


def refuse_non_float(grads: Any, where: str) -> None:
    """Raises ``GradientDtypeError`` naming the first integer or bool leaf of ``grads``.

    Such a leaf can be neither unscaled nor checked, and would reach the inner optimizer
    scaled. ``float0`` leaves (what ``jax.grad(..., allow_int=True)`` gives for integer
    parameters) carry no value and pass.
    """
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        dtype = getattr(g, "dtype", None)
        if dtype is None or dtype == jax.dtypes.float0 or jnp.issubdtype(dtype, jnp.inexact):
            continue
        raise GradientDtypeError(
            f"{where}: the gradient leaf at {jax.tree_util.keystr(path) or 'the root'} is "
            f"{np.dtype(dtype).name}: it can be neither unscaled nor checked for overflow, "
            "and would reach the inner optimizer multiplied by the loss scale. Gradients "
            "must be floating (take them with jax.grad; jax.grad(..., allow_int=True) gives "
            "float0 leaves for integer parameters, which pass), or cast the leaf: "
            "g.astype(jnp.float32)."
        )


def refuse_scaled_twice(loss: Any) -> None:
    """Raises ``WiringError`` when ``loss`` already went through ``scale_loss`` in the
    differentiation (or, outside one, the ``jit`` trace) it is computed in."""
    frame = _tracers.current_frame()
    notes = _FRAMES.get(frame) if frame is not None else None
    if notes is None or not notes.outputs:
        return
    primal = _tracers.jit_tracer(loss)
    if primal is None:
        return
    # Under grad, follow only the forward pass of a differentiation: a scaled loss of an
    # earlier step of the same trace reaches this one through that step's update, not there.
    differentiated = primal is not loss
    seen = _tracers.walk([primal], _live(notes.outputs), through="jvp" if differentiated else None)
    if seen.found:
        raise WiringError(
            "lsj.scale_loss was given a loss that already went through lsj.scale_loss in "
            "this step: the gradients would be scaled twice, and every update would be too "
            "large by the loss scale (the scale backs off and then applies them). Scale the "
            "loss once: return the plain loss from your loss function and scale it where the "
            "gradients are taken (lsj.value_and_grad does both)."
        )


def scaled(loss: Any, scale: Any, out: Any) -> None:
    """Notes that ``scale_loss`` multiplied ``loss`` by ``scale`` into ``out``."""
    frame = _tracers.current_frame()
    if frame is None:
        return
    notes = _FRAMES.setdefault(frame, _Notes())
    if _tracers.is_tracer(scale):
        notes.scales.append(weakref.ref(scale))
    elif _tracers.is_tracer(loss):
        notes.constants.append(scale)  # a constant of the traced step
    primal = _tracers.jit_tracer(out)
    if primal is not None:
        notes.outputs.append(weakref.ref(primal))


def check_update(grads: Any, scale: Any, where: str, constant_scale: float | None) -> None:
    """The check ``Engine.check`` runs on the gradients and scale an update was given.

    ``constant_scale`` is the policy's (``LossScalePolicy.constant_scale``): 1 skips the
    check, any constant skips the frozen-scale error (a constant cannot go stale).
    """
    if constant_scale == 1.0:
        return
    target = _tracers.jit_tracer(scale)
    if target is None or target is not scale:
        return  # a concrete state (eager, or a constant of the step), or under vmap
    frame = _tracers.frame_of(target)
    notes = _FRAMES.get(frame, _Notes())
    used = _live(notes.scales)
    if any(_same(_tracers.jit_tracer(s), target) for s in used):
        return
    leaves = [g for g in jax.tree_util.tree_leaves(grads) if _tracers.jit_tracer(g) is g]
    leaves = [g for g in leaves if _tracers.frame_of(g) is frame]
    if not leaves:
        return
    seen = _tracers.walk(leaves, [target])
    if seen.found:
        return
    if notes.constants and constant_scale is not None:
        return  # scale_loss read a constant policy's scale from outside: it cannot go stale
    if notes.constants:
        value = float(jax.device_get(notes.constants[-1]))
        raise WiringError(
            f"{where}: lsj.scale_loss multiplied the loss by a loss scale that is a constant "
            f"of this traced step ({value:g}), while update divides by the scale of the "
            "optimizer state the step receives: the loss would keep the scale of the step "
            "that was traced whatever the state holds later, and the updates would be off by "
            "their ratio. Give scale_loss the optimizer state (or NNX optimizer) the step "
            "receives as an argument, not one captured from outside it (a closure over the "
            "optimizer object or a global)."
        )
    if used:
        warnings.warn(
            f"{where}: the gradients do not depend on the loss scale of the optimizer state "
            "given to update, while lsj.scale_loss used another state's scale in this step. "
            "Right only if the two scales are equal (micro-batches of one accumulation "
            "window); otherwise the updates are off by their ratio. " + _FIX,
            WiringWarning,
            stacklevel=4,
        )
    elif seen.backward:
        raise WiringError(
            f"{where}: the gradients given to update were computed in this step from a loss "
            "that was never multiplied by the optimizer state's loss scale, yet update "
            "divides them by it: every update would be too small by the scale (2**15 at "
            "DynamicScale's start), and training would crawl. " + _FIX + " A trainer that "
            "takes grad(loss) itself needs its integration (lossscale_jax.integrations)."
        )


def _same(a: Any, b: Any) -> bool:
    return a is not None and _tracers.same_value(a, b)
