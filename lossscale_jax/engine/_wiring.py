"""The wiring check: a step wired so that it would train silently wrong is refused.

A loss-scaled step is right when the gradients ``update`` divides by the scale ``S`` are the
backward pass of a loss multiplied by ``S`` once, with ``S`` in the backward pass's cotangent
from its start (so that float16 cannot underflow there). Inside one traced step (``jit``,
``shard_map``, ``pmap``, a ``scan`` body: a *frame*, see ``_tracers``) the library sees both
ends. When ``update`` is traced with a traced scale, ``_interpret`` runs the rules of
``_powers`` over the step traced so far, backward pass, loops, calls and remat included, and
says which power of ``S`` each gradient leaf carries, and whether ``S`` reached it through the
backward pass (mark 2) or outside it (mark 1); ``_verdicts`` says what that means. Per leaf,
each alternative it may take (a select picks one)::

  S**1, through the backward pass    right
  zero                               right (a leaf the loss does not depend on)
  S**1, some of it after the pass    WiringWarning: the size is right, float16's underflow
                                     in the backward pass is not prevented
  S**0 (never reached by S)          WiringError where a backward pass of this frame made it:
                                     too small by S (a loss never scaled); else nothing (the
                                     gradients came from outside the step)
  S**0 (S divided out)               WiringError: too small by S (unscaled before update)
  S**k, k >= 2 / k < 1               WiringError: too large by S**(k-1) / too small by S**(1-k)
  a sum of powers                    WiringError: a part of the loss is not scaled
  unknown (S through exp, tanh...)   WiringWarning: the check cannot tell

A leaf is refused only when every alternative is wrong; one that is right in some and wrong
in others warns. Where a leaf is never reached by ``S``, the scales of other states of the
frame are tried: gradients scaled with another state's scale warn (a window's micro-batches
taken with its first state) or, where the two states are swapped, are refused. A scale that
``scale_loss`` read as a constant of the traced step (a closure over the optimizer) while the
policy moves it is refused. ``lsj.value_and_grad`` refuses, where it returns them, gradients
that carry the scale to a power of at least 2 (a loss function that scaled its own loss).

Off switches: ``check_wiring=False`` on ``loss_scaling``, ``loss_scaling_multi_steps`` and
``layerwise_scaling`` (one transformation), and ``with no_wiring_check():`` around the first
call of a step (everything traced in the block). What it cannot see: eager (un-jitted)
calls, gradients computed in another ``jit`` or passed in as arguments, values carried
through integers or booleans. A policy whose scale is always 1 (``NoScale``,
``StaticScale(1.0)``) is not checked. Nothing here changes a step's program: the check reads
the trace and raises, or warns, or not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale_jax.engine import _interpret, _tracers, _verdicts
from lossscale_jax.engine._verdicts import (
    CANCELLED,
    FREE,
    LARGE,
    MIXED,
    OUTSIDE,
    RIGHT,
    SMALL,
    WRONG,
    leaf,
    off,
)
from lossscale_jax.errors import GradientDtypeError, WiringError, WiringWarning


class _Switch(threading.local):
    off = 0


_SWITCH = _Switch()


@contextlib.contextmanager
def no_wiring_check() -> Iterator[None]:
    """Turns the wiring check off for every step traced inside the block.

    The check runs while a step is traced (its first call under ``jax.jit``), so the block
    must hold that first call; later calls of the compiled step are not traced again. For
    one transformation, pass ``check_wiring=False`` to ``loss_scaling`` (or
    ``loss_scaling_multi_steps``, ``layerwise_scaling``) instead. The check never changes a
    step's program: turning it off changes nothing but the errors and warnings.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> tx = lsj.loss_scaling(optax.sgd(0.1), lsj.StaticScale(64.0))
      >>> params = {"w": jnp.ones(2)}
      >>> step = jax.jit(lambda p, s: tx.update(jax.grad(lambda p: jnp.sum(p["w"]))(p), s, p))
      >>> with lsj.no_wiring_check():   # the gradients of an unscaled loss: not refused
      ...     updates, state = step(params, tx.init(params))
    """
    _SWITCH.off += 1
    try:
        yield
    finally:
        _SWITCH.off -= 1


def enabled() -> bool:
    """Whether the check runs here (no ``no_wiring_check`` block is open in this thread)."""
    return _SWITCH.off == 0 and _tracers.AVAILABLE


def validate_switch(check_wiring: Any) -> bool:
    """Returns ``check_wiring`` if it is a bool, else raises ``TypeError`` naming it."""
    if not isinstance(check_wiring, bool | np.bool_):
        raise TypeError(f"check_wiring must be True or False, got {check_wiring!r}.")
    return bool(check_wiring)


@dataclasses.dataclass
class _Notes:
    """What ``scale_loss`` and the updates did in one frame (weak references to tracers: a
    note never keeps a frame's tracers alive; the analyses hold its variables only)."""

    scales: list[weakref.ref] = dataclasses.field(default_factory=list)
    constants: list[Any] = dataclasses.field(default_factory=list)
    # The updates traced so far: (the scale each divided by, the scales its gradients carried)
    updates: list[tuple[weakref.ref, list[weakref.ref]]] = dataclasses.field(default_factory=list)
    # One analysis per scale, kept for the frame's later questions (its variables never change)
    analyses: dict[Any, _interpret.Powers] = dataclasses.field(default_factory=dict)

    def powers(self, target: Any) -> _interpret.Powers:
        key = _tracers.variable(target)
        found = self.analyses.get(key)
        if found is None:
            found = self.analyses[key] = _interpret.Powers(target)
        return found


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


def refuse_scaled_twice(grads: Any, scale: Any) -> None:
    """Raises ``WiringError`` when the gradients ``lsj.value_and_grad`` took of the scaled
    loss carry ``scale`` to a power of at least 2 in every leaf and every form: the loss
    function scaled its loss itself, and the gradients would be scaled twice."""
    if not enabled():
        return
    target = _tracers.jit_tracer(scale)
    if target is None or target is not scale:
        return
    frame = _tracers.frame_of(target)
    tracers = [g for g in jax.tree_util.tree_leaves(grads) if _tracers.jit_tracer(g) is g]
    tracers = [g for g in tracers if _tracers.frame_of(g) is frame]
    if not tracers:
        return
    powers = _FRAMES.setdefault(frame, _Notes()).powers(target)
    if not all(leaf("", powers.value(g), True).verdict == LARGE for g in tracers):
        return
    raise WiringError(_verdicts.scaled_twice())


def scaled(loss: Any, scale: Any) -> None:
    """Notes that ``scale_loss`` multiplied ``loss`` by ``scale``."""
    frame = _tracers.current_frame()
    if frame is None:
        return
    notes = _FRAMES.setdefault(frame, _Notes())
    if _tracers.is_tracer(scale):
        notes.scales.append(weakref.ref(scale))
    elif _tracers.is_tracer(loss):
        notes.constants.append(scale)  # a constant of the traced step


def check_update(grads: Any, scale: Any, where: str, policy: Any, switched_on: bool) -> None:
    """The check ``Engine.check`` runs on the gradients and scale an update was given.

    ``policy`` (the front-end's) names the scale in the messages; its ``constant_scale`` of 1
    skips the check, any constant skips the frozen-scale error (a constant cannot go stale).
    ``switched_on``: the transformation's ``check_wiring``.
    """
    if not switched_on or not enabled() or policy.constant_scale == 1.0:
        return
    target = _tracers.jit_tracer(scale)
    if target is None or target is not scale or _tracers.variable(target) is None:
        return  # a concrete state (eager, or a literal of the step), or under vmap
    frame = _tracers.frame_of(target)
    notes = _FRAMES.setdefault(frame, _Notes())
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    pairs = [(jax.tree_util.keystr(p) or "the root", g) for p, g in flat]
    pairs = [(p, g) for p, g in pairs if _tracers.jit_tracer(g) is g]
    pairs = [(p, g) for p, g in pairs if _tracers.frame_of(g) is frame]
    if not pairs:
        return
    powers = notes.powers(target)
    leaves = [leaf(p, powers.value(g), powers.backward(g)) for p, g in pairs]
    # Leaves never reached by the scale and made by no backward pass of this frame came
    # from outside the step: not seen.
    # (or came in as they are: an input of the step, moved or summed).
    leaves = [x for x in leaves if not (x.verdict == FREE and not x.backward)]
    leaves = [x for x in leaves if x.verdict != OUTSIDE]
    if all(x.verdict == RIGHT for x in leaves):
        notes.updates.append((weakref.ref(target), [weakref.ref(target)]))
        return
    wrong = [x for x in leaves if x.verdict in WRONG]
    carrying = [x for x in leaves if not x.zero]  # a zero leaf says nothing of any scale
    if wrong and all(x.verdict == FREE for x in carrying):
        tracers = [g for (p, g), x in zip(pairs, leaves, strict=False) if x.verdict == FREE]
        _refuse_unscaled(tracers, target, notes, where, policy)
        return
    notes.updates.append((weakref.ref(target), [weakref.ref(target)]))
    if wrong:
        order = (MIXED, LARGE, SMALL, CANCELLED, FREE)
        first = min(wrong, key=lambda x: order.index(x.verdict))
        share = f"{len(wrong)} of {len(leaves)} gradient leaves, the first at {first.path}"
        raise WiringError(f"{where}: {_verdicts.found(first, share, policy)}" + off(where))
    first = next(x for x in leaves if x.verdict != RIGHT)
    warnings.warn(
        f"{where}: {_verdicts.uncertain(first, policy)}" + off(where), WiringWarning, stacklevel=5
    )


def _refuse_unscaled(
    leaves: list[Any], target: Any, notes: _Notes, where: str, policy: Any
) -> None:
    """The gradients were made by a backward pass this state's scale never reached: why."""
    if notes.constants and policy.constant_scale is not None:
        return  # scale_loss read a constant policy's scale from outside: it cannot go stale
    if notes.constants:
        raise WiringError(_verdicts.frozen(where, float(jax.device_get(notes.constants[-1]))))
    used = _live(notes.scales)
    own = any(_same(_tracers.jit_tracer(s), target) for s in used)
    others = _others(notes, target)
    by = [s for s in others if _right(notes.powers(s), leaves)]
    notes.updates.append((weakref.ref(target), [weakref.ref(s) for s in by]))
    if by:
        if own or _swapped(notes, target, by):
            raise WiringError(_verdicts.swapped(where))
        warnings.warn(_verdicts.other_state(where), WiringWarning, stacklevel=5)
        return
    if own:
        raise WiringError(_verdicts.logged_only(where, policy))
    raise WiringError(_verdicts.never_scaled(where, policy))


def _right(powers: _interpret.Powers, leaves: list[Any]) -> bool:
    """Whether every leaf carries that analysis's scale once, through the backward pass."""
    return all(leaf("", powers.value(g), True).verdict == RIGHT for g in leaves)


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


def _same(a: Any, b: Any) -> bool:
    return a is not None and b is not None and _tracers.same_value(a, b)
