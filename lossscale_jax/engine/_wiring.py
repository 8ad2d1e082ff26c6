"""The wiring check: a step wired so that it would train silently wrong is refused.

A loss-scaled step is right when the gradients ``update`` divides by the scale are the
backward pass of a loss multiplied by that same scale, once. Inside one traced step (``jit``,
``shard_map``, ``pmap``, a ``scan`` body: a *frame*, see ``_tracers``) the library sees both
ends: ``scale_loss`` notes here which scale it multiplied by and what it returned, and
``Engine.check`` asks, when ``update`` is traced with a traced scale, how the gradients carry
it (``_tracers.carried``): how many times the scale entered their backward pass along one
path (``depth``), whether they depend on it otherwise (``forward``: after the backward pass),
and whether a loop or call of the frame read it where the walk cannot see (``opaque``).

- depth 1: wired right (``scale_loss``, or a hand-written ``loss * scale``);
- an opaque use and depth 0 or 1: nothing (the check cannot tell);
- depth 2 or more: ``WiringError``, the loss scaled twice (``scale_loss`` and a
  multiplication by the scale by hand, or ``scale_loss`` of a loss that already holds it);
- depth 0 (the gradients are not the backward pass of a loss scaled by this state):
  - ``scale_loss`` multiplied by a *constant* of the step while the policy moves the scale
    (the state read through a closure): ``WiringError``, the loss keeps the traced step's
    scale forever;
  - the gradients carry another state's scale of this step: ``WiringError`` when the two
    states are swapped (this state's scale went into another loss of the step, or the other
    state was updated with gradients scaled by this one), else ``WiringWarning`` (a window of
    micro-batches whose gradients were all taken before their updates is right);
  - the gradients depend on the scale after their backward pass only (a clipping threshold
    of ``max_norm * scale``): ``WiringError``;
  - they were computed in this step by a backward pass: ``WiringError``, the gradients of a
    loss never multiplied by the scale (``scale_loss`` called in the step for logging only,
    or not at all: a trainer that takes ``grad(loss)`` itself);
  - else the gradients came from outside the step (another ``jit``, an argument): nothing.

And ``scale_loss`` refuses a loss that already went through ``scale_loss`` in the same
differentiation (``WiringError``: every update too large by the scale).

What it cannot see: eager (un-jitted) calls, gradients computed in another ``jit`` or
passed in as arguments, a backward pass inside a loop body or a nested ``jit`` whose
gradients leave it, gradients whose leaves are each right but were put together from
differently wired passes. A policy whose scale is always 1 (``NoScale``,
``StaticScale(1.0)``) is not checked. Nothing here changes a step's program: the check reads
the trace and raises, or warns, or not.
"""

from __future__ import annotations

import dataclasses
import math
import sys
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
_TUNIX = (
    " Tunix is imported: a Tunix trainer given lsj.loss_scaling(...) as its optimizer takes "
    "grad(loss) itself; build the trainer with its own optimizer and call "
    "lossscale_jax.integrations.tunix.enable(trainer) instead."
)


@dataclasses.dataclass
class _Notes:
    """What ``scale_loss`` did in one frame (weak references: a note never keeps a frame's
    tracers alive)."""

    scales: list[weakref.ref] = dataclasses.field(default_factory=list)
    constants: list[Any] = dataclasses.field(default_factory=list)
    outputs: list[weakref.ref] = dataclasses.field(default_factory=list)
    # The updates traced so far: (the scale each divided by, the scales its gradients carried)
    updates: list[tuple[weakref.ref, list[weakref.ref]]] = dataclasses.field(default_factory=list)


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


def check_update(grads: Any, scale: Any, where: str, policy: Any) -> None:
    """The check ``Engine.check`` runs on the gradients and scale an update was given.

    ``policy`` (the front-end's) names the scale in the messages; its ``constant_scale`` of 1
    skips the check, any constant skips the frozen-scale error (a constant cannot go stale).
    """
    constant_scale = policy.constant_scale
    if constant_scale == 1.0:
        return
    target = _tracers.jit_tracer(scale)
    if target is None or target is not scale:
        return  # a concrete state (eager, or a constant of the step), or under vmap
    frame = _tracers.frame_of(target)
    notes = _FRAMES.setdefault(frame, _Notes())
    leaves = [g for g in jax.tree_util.tree_leaves(grads) if _tracers.jit_tracer(g) is g]
    leaves = [g for g in leaves if _tracers.frame_of(g) is frame]
    if not leaves:
        return
    seen = _tracers.carried(leaves, target)
    if seen.depth >= 2:
        raise WiringError(
            f"{where}: the gradients given to update carry the optimizer state's loss scale "
            "twice: the loss was multiplied by it more than once before the backward pass "
            "(lsj.scale_loss and a multiplication by the scale read by hand, or lsj.scale_loss "
            "of a value that already holds it), so every update would be too large by the "
            f"scale ({_in_force(policy)}"
            + (", e.g. 256 times once it is 2**8" if policy.constant_scale is None else "")
            + "). Scale the loss once: lsj.scale_loss(loss, opt_state) of the plain loss, or "
            "lsj.value_and_grad(loss_fn, opt_state)."
        )
    if seen.depth == 1 or seen.opaque:
        notes.updates.append((weakref.ref(target), [weakref.ref(target)]))
        return
    _refuse_unscaled(leaves, target, notes, seen, where, policy)


def _refuse_unscaled(
    leaves: list[Any], target: Any, notes: _Notes, seen: Any, where: str, policy: Any
) -> None:
    """The gradients are not the backward pass of a loss this state scaled: why, if seen."""
    if notes.constants and policy.constant_scale is not None:
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
    used = _live(notes.scales)
    own = any(_same(_tracers.jit_tracer(s), target) for s in used)
    others = _others(notes, target)
    by = [s for s in others if _tracers.carried(leaves, s).depth >= 1]
    notes.updates.append((weakref.ref(target), [weakref.ref(s) for s in by]))
    if by:
        if own or _swapped(notes, target, by):
            raise WiringError(
                f"{where}: the gradients given to update are scaled by another optimizer "
                "state's loss scale, while this state's scale scaled another loss of the "
                "same step: the two states are swapped (each loss scaled with the other "
                "model's state), so each update would be off by the ratio of the two "
                "scales, and each scale would back off for the other model's overflows. "
                "Scale each loss with the optimizer state of the parameters it updates: "
                "lsj.value_and_grad(loss_fn, opt_state) with that model's opt_state."
            )
        warnings.warn(
            f"{where}: the gradients do not carry the loss scale of the optimizer state "
            "given to update, but another state's scale of this step. Right only if the two "
            "scales are equal (micro-batches of one accumulation window, taken with the "
            "window's first state); otherwise the updates are off by their ratio. " + _FIX,
            WiringWarning,
            stacklevel=5,
        )
        return
    if not seen.backward:
        return  # gradients from outside the step: not seen
    if seen.forward:
        raise WiringError(
            f"{where}: the gradients given to update depend on the optimizer state's loss "
            "scale only after their backward pass (a clipping threshold of max_norm * scale, "
            "or a product taken after jax.grad): they are the gradients of a loss that was "
            "never multiplied by the scale, and update divides them by it, so every update "
            f"would be too small by the scale ({_in_force(policy)}). " + _FIX + " Clip "
            "inside the loss scaling, on the unscaled gradients: "
            "lsj.loss_scaling(optax.chain(optax.clip_by_global_norm(max_norm), inner), policy)."
        )
    if own:
        raise WiringError(
            f"{where}: the gradients given to update are not the backward pass of the loss "
            "lsj.scale_loss scaled in this step: lsj.scale_loss was called with this state, "
            "but the gradients were taken of another loss, never multiplied by the scale "
            "(the scaled loss only logged?), and update divides them by it: every update "
            f"would be too small by the scale ({_in_force(policy)}). " + _FIX
        )
    raise WiringError(
        f"{where}: the gradients given to update were computed in this step from a loss "
        "that was never multiplied by the optimizer state's loss scale, yet update divides "
        f"them by it: every update would be too small by the scale ({_in_force(policy)}), "
        "and training would crawl. " + _FIX + " A trainer that takes grad(loss) itself "
        "needs its integration (lossscale_jax.integrations)." + (_TUNIX if _tunix() else "")
    )


def _others(notes: _Notes, target: Any) -> list[Any]:
    """The scales of this frame other than ``target``: those ``scale_loss`` multiplied by,
    those earlier updates divided by (one tracer per variable)."""
    out: list[Any] = []
    candidates = _live(notes.scales) + _live([ref for ref, _ in notes.updates])
    for s in candidates:
        s = _tracers.jit_tracer(s)
        if s is None or _same(s, target) or any(_same(s, o) for o in out):
            continue
        if _tracers.frame_of(s) is _tracers.frame_of(target):
            out.append(s)
    return out


def _swapped(notes: _Notes, target: Any, by: list[Any]) -> bool:
    """Whether a state whose scale these gradients carry was updated earlier in the step with
    gradients that carried ``target``."""
    for ref, carried in notes.updates:
        other = ref()
        if other is None or not any(_same(other, s) for s in by):
            continue
        if any(_same(c, target) for c in _live(carried)):
            return True
    return False


def _in_force(policy: Any) -> str:
    """The scale a policy holds, as a message names it."""
    name = type(policy).__name__
    constant = policy.constant_scale
    if constant is not None:
        return f"{_number(constant)}, {name}'s"
    start = getattr(policy, "init_scale", None)
    if isinstance(start, int | float):
        return f"{_number(start)} at this {name}'s start, then wherever it moves"
    return f"the scale {name} holds"


def _number(x: float) -> str:
    exponent = math.log2(x) if x > 0 else 0.5
    if exponent == int(exponent) and exponent >= 2:
        return f"2**{int(exponent)}"
    return f"{x:g}"


def _tunix() -> bool:
    return "tunix" in sys.modules


def _same(a: Any, b: Any) -> bool:
    return a is not None and b is not None and _tracers.same_value(a, b)
