"""The wiring check: a step wired so that it would train silently wrong is refused.

A loss-scaled step is right when the gradients ``update`` divides by the scale ``S`` are the
backward pass of a loss multiplied by ``S`` once, with ``S`` in the backward pass's cotangent
from its start (so that float16 cannot underflow there). Inside one traced step (``jit``,
``shard_map``, ``pmap``, a ``scan`` body: a *frame*, see ``_tracers``) the library sees both
ends. When ``update`` is traced with a traced scale, ``_powers`` interprets the step traced so
far, backward pass, loops, calls and remat included, and says which power of ``S`` each
gradient leaf carries, and whether ``S`` reached it through the backward pass (mark 2) or
outside it (mark 1). Per leaf, each alternative it may take (a select picks one)::

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
policy moves it is refused. ``scale_loss`` refuses a loss that already carries the scale to a
power of at least 1 in every alternative (every update too large).

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
import math
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale_jax.engine import _powers, _tracers
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
# The transformations that take check_wiring= (the others are turned off by the block).
SWITCHED = ("loss_scaling", "loss_scaling_multi_steps", "layerwise_scaling")


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


def _off(where: str) -> str:
    """How to turn the check off, as every message says it."""
    one = f"{where}(..., check_wiring=False) for this transformation, or " if where in SWITCHED else ""
    return (
        f" If the step is right, turn the check off: {one}trace the step inside `with "
        "lsj.no_wiring_check():` (docs/errors.md, the wiring check)."
    )


@dataclasses.dataclass
class _Notes:
    """What ``scale_loss`` and the updates did in one frame (weak references to tracers: a
    note never keeps a frame's tracers alive; the analyses hold its variables only)."""

    scales: list[weakref.ref] = dataclasses.field(default_factory=list)
    constants: list[Any] = dataclasses.field(default_factory=list)
    # The updates traced so far: (the scale each divided by, the scales its gradients carried)
    updates: list[tuple[weakref.ref, list[weakref.ref]]] = dataclasses.field(default_factory=list)
    # One analysis per scale, kept for the frame's later questions (its variables never change)
    analyses: dict[Any, _powers.Powers] = dataclasses.field(default_factory=dict)

    def powers(self, target: Any) -> _powers.Powers:
        key = _tracers.variable(target)
        found = self.analyses.get(key)
        if found is None:
            found = self.analyses[key] = _powers.Powers(target)
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


def refuse_scaled_twice(loss: Any, scale: Any) -> None:
    """Raises ``WiringError`` when ``loss`` already carries ``scale`` (to a power of at least
    1 in every form it may take): multiplied by it again, its gradients carry it twice."""
    if not enabled():
        return
    primal, target = _tracers.jit_tracer(loss), _tracers.jit_tracer(scale)
    if primal is None or target is None or target is not scale:
        return
    if _tracers.frame_of(primal) is not _tracers.frame_of(target):
        return
    notes = _FRAMES.setdefault(_tracers.frame_of(target), _Notes())
    value = notes.powers(target).value(primal)
    if value is None or not all(alt and all(k >= 1 for k, _ in alt) for alt in value):
        return
    raise WiringError(
        "lsj.scale_loss was given a loss that already carries the optimizer state's loss "
        "scale (it went through lsj.scale_loss, or was multiplied by the scale by hand, in "
        "this step): the gradients would be scaled twice, and every update would be too "
        "large by the loss scale (the scale backs off and then applies them). Scale the "
        "loss once: return the plain loss from your loss function and scale it where the "
        "gradients are taken (lsj.value_and_grad does both)." + _off("loss_scaling")
    )


def scaled(loss: Any, scale: Any, out: Any) -> None:
    """Notes that ``scale_loss`` multiplied ``loss`` by ``scale`` into ``out``."""
    del out
    frame = _tracers.current_frame()
    if frame is None:
        return
    notes = _FRAMES.setdefault(frame, _Notes())
    if _tracers.is_tracer(scale):
        notes.scales.append(weakref.ref(scale))
    elif _tracers.is_tracer(loss):
        notes.constants.append(scale)  # a constant of the traced step


# -- what one leaf carries -------------------------------------------------------------------

RIGHT, AFTER, FREE, CANCELLED, LARGE, SMALL, MIXED, UNKNOWN = (
    "right", "after", "free", "cancelled", "large", "small", "mixed", "unknown",
)  # fmt: skip
_WRONG = frozenset({FREE, CANCELLED, LARGE, SMALL, MIXED})


def _kind(alt: frozenset[tuple[Fraction, int]]) -> tuple[str, Fraction]:
    """One alternative of a gradient: what it is, and its power."""
    if not alt:
        return RIGHT, Fraction(1)
    powers = {k for k, _ in alt}
    if len(powers) > 1:
        return MIXED, Fraction(0)
    (k,) = powers
    marks = {m for _, m in alt}
    if k == 1:
        return (RIGHT if marks == {2} else AFTER), k
    if k == 0:
        return (FREE if marks == {0} else CANCELLED), k
    return (LARGE if k > 1 else SMALL), k


@dataclasses.dataclass(frozen=True)
class _Leaf:
    path: str
    verdict: str  # RIGHT, a kind of _WRONG (every alternative wrong), "warn"
    kinds: tuple[tuple[str, Fraction], ...]
    backward: bool
    powers: tuple[Fraction, ...] = ()  # every power a term of the leaf carries


def _leaf(path: str, value: _powers.Value, backward: bool) -> _Leaf:
    if value is None:
        return _Leaf(path, "warn", ((UNKNOWN, Fraction(0)),), backward)
    kinds = tuple(sorted({_kind(alt) for alt in value}, key=str))
    names = {n for n, _ in kinds}
    powers = tuple(sorted({k for alt in value for k, _ in alt}))
    if names == {RIGHT}:
        return _Leaf(path, RIGHT, kinds, backward, powers)
    wrong = [n for n, _ in kinds if n in _WRONG]
    if len(wrong) == len(kinds):
        order = (MIXED, LARGE, SMALL, CANCELLED, FREE)
        return _Leaf(path, next(n for n in order if n in names), kinds, backward, powers)
    return _Leaf(path, "warn", kinds, backward, powers)


def check_update(
    grads: Any, scale: Any, where: str, policy: Any, *, switched_on: bool = True
) -> None:
    """The check ``Engine.check`` runs on the gradients and scale an update was given.

    ``policy`` (the front-end's) names the scale in the messages; its ``constant_scale`` of 1
    skips the check, any constant skips the frozen-scale error (a constant cannot go stale).
    ``switched_on``: the transformation's ``check_wiring``.
    """
    if not switched_on or not enabled() or policy.constant_scale == 1.0:
        return
    target = _tracers.jit_tracer(scale)
    if target is None or target is not scale:
        return  # a concrete state (eager, or a constant of the step), or under vmap
    frame = _tracers.frame_of(target)
    notes = _FRAMES.setdefault(frame, _Notes())
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    pairs = [(jax.tree_util.keystr(p) or "the root", g) for p, g in flat]
    pairs = [(p, g) for p, g in pairs if _tracers.jit_tracer(g) is g]
    pairs = [(p, g) for p, g in pairs if _tracers.frame_of(g) is frame]
    if not pairs:
        return
    powers = notes.powers(target)
    leaves = [_leaf(p, powers.value(g), powers.backward(g)) for p, g in pairs]
    # Leaves never reached by the scale and made by no backward pass of this frame came
    # from outside the step: not seen.
    leaves = [x for x in leaves if not (x.verdict == FREE and not x.backward)]
    if all(x.verdict == RIGHT for x in leaves):
        notes.updates.append((weakref.ref(target), [weakref.ref(target)]))
        return
    wrong = [x for x in leaves if x.verdict in _WRONG]
    if wrong and all(x.verdict == FREE for x in wrong) and len(wrong) == len(leaves):
        tracers = [g for (p, g), x in zip(pairs, leaves, strict=False) if x.verdict == FREE]
        _refuse_unscaled(tracers, target, notes, where, policy)
        return
    notes.updates.append((weakref.ref(target), [weakref.ref(target)]))
    if wrong:
        first = wrong[0]
        share = f"{len(wrong)} of {len(leaves)} gradient leaves, the first at {first.path}"
        raise WiringError(f"{where}: {_found(first, share, policy)}" + _off(where))
    first = next(x for x in leaves if x.verdict != RIGHT)
    warnings.warn(
        f"{where}: {_uncertain(first, policy)}" + _off(where), WiringWarning, stacklevel=5
    )


def _found(leaf: _Leaf, share: str, policy: Any) -> str:
    """What the analysis found, for a leaf wrong in every alternative."""
    k = next((k for n, k in leaf.kinds if n == leaf.verdict), Fraction(0))
    scale = _in_force(policy)
    if leaf.verdict == LARGE:
        by = "the scale" if k == 2 else f"the scale to the power {k - 1}"
        return (
            f"the gradients given to update carry the optimizer state's loss scale to the "
            f"power {k} ({share}): the loss was multiplied by it more than once before the "
            "backward pass (lsj.scale_loss and a multiplication by the scale by hand, the "
            "gradients multiplied by it after jax.grad, or lsj.scale_loss of a value that "
            f"already holds it), so every update would be too large by {by} ({scale}"
            + (", e.g. 256 times once it is 2**8" if k == 2 and policy.constant_scale is None else "")
            + "). Scale the loss once: lsj.scale_loss(loss, opt_state) of the plain loss, "
            "or lsj.value_and_grad(loss_fn, opt_state)."
        )
    if leaf.verdict == SMALL:
        return (
            f"the gradients given to update carry the optimizer state's loss scale to the "
            f"power {k} ({share}): the scale was divided out more often than it was "
            "multiplied in (a scaled loss divided by the scale, or gradients unscaled by "
            f"hand), so every update would be too small by the scale to the power {1 - k} "
            f"({scale}). " + _FIX
        )
    if leaf.verdict == CANCELLED:
        return (
            f"the gradients given to update carry the optimizer state's loss scale to the "
            f"power 0 ({share}): the scale entered them and was divided out again (the "
            "gradients unscaled before update, by g / scale, lsj.unscale or "
            "lsj.unscale_and_check, or a scaled loss divided by the scale), and update "
            "divides them by the scale once more: every update would be too small by the "
            f"scale ({scale}). Give update the scaled gradients as jax.grad returns them: "
            "it unscales them itself (read unscaled ones for logging with "
            "lsj.unscaled_global_norm)."
        )
    if leaf.verdict == MIXED:
        seen = ", ".join(str(k) for k in leaf.powers)
        return (
            f"the gradients given to update are a sum of parts that carry the optimizer "
            f"state's loss scale to different powers ({share}; powers seen: {seen}): a part "
            "of the loss was multiplied by the scale and a part was not "
            "(lsj.scale_loss(a, opt_state) + b, or lsj.scale_loss of a sum one of whose "
            "terms was already scaled), or a term was added to the scaled gradients (a "
            "weight decay by hand); update divides the sum by the scale once, so every part "
            "but those carrying it to the power 1 would be off by the scale "
            f"({scale}). Scale the whole plain loss once: lsj.scale_loss(a + b, opt_state), "
            "and put weight decay inside the loss scaling "
            "(lsj.loss_scaling(optax.adamw(...), policy))."
        )
    return (  # FREE, beside leaves that are right
        f"the gradients given to update carry no loss scale in part of the tree ({share}), "
        "while the rest carry it: those leaves are the backward pass of a loss that was "
        "never multiplied by the scale, and update divides them by it: their updates "
        f"would be too small by the scale ({scale}). Take every leaf's gradient from the "
        "one scaled loss (lsj.scale_loss of the sum of the losses)."
    )


def _uncertain(leaf: _Leaf, policy: Any) -> str:
    """What the analysis found, for a leaf it cannot prove wrong."""
    names = {n for n, _ in leaf.kinds}
    if names == {UNKNOWN}:
        return (
            f"the gradient leaf at {leaf.path} depends on the optimizer state's loss scale "
            "through a function that is not a power of it (exp, log, tanh, a loss that is "
            "not linear in its scaled value...): the check cannot tell whether update "
            "divides it by the scale it carries. Scale the loss last: lsj.scale_loss(loss, "
            "opt_state) of the finished loss."
        )
    if names <= {RIGHT, AFTER}:
        return (
            f"the gradient leaf at {leaf.path} carries the optimizer state's loss scale "
            "once, but the scale reached it (or part of it) after the backward pass (the "
            "gradients multiplied by the scale after jax.grad): the size of every update is "
            "right, but the backward pass ran unscaled, so float16 gradients that underflow "
            "there are lost: loss scaling does not do its work. " + _FIX
        )
    found = ", ".join(
        f"{n} (power {k})" if n not in (RIGHT, UNKNOWN) else n for n, k in leaf.kinds
    )
    return (
        f"the gradient leaf at {leaf.path} takes one of several forms (a select, a max, a "
        f"branch or a loop picks between them): {found}. Only a form that carries the loss "
        "scale once, through the backward pass, gives the right update; the check cannot "
        f"tell which form a step takes ({_in_force(policy)}). " + _FIX
    )


def _refuse_unscaled(leaves: list[Any], target: Any, notes: _Notes, where: str, policy: Any) -> None:
    """The gradients were made by a backward pass this state's scale never reached: why."""
    if notes.constants and policy.constant_scale is not None:
        return  # scale_loss read a constant policy's scale from outside: it cannot go stale
    off = _off(where)
    if notes.constants:
        value = float(jax.device_get(notes.constants[-1]))
        raise WiringError(
            f"{where}: lsj.scale_loss multiplied the loss by a loss scale that is a constant "
            f"of this traced step ({value:g}), while update divides by the scale of the "
            "optimizer state the step receives: the loss would keep the scale of the step "
            "that was traced whatever the state holds later, and the updates would be off by "
            "their ratio. Give scale_loss the optimizer state (or NNX optimizer) the step "
            "receives as an argument, not one captured from outside it (a closure over the "
            "optimizer object or a global)." + off
        )
    used = _live(notes.scales)
    own = any(_same(_tracers.jit_tracer(s), target) for s in used)
    others = _others(notes, target)
    by = [s for s in others if _right(notes.powers(s), leaves)]
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
                "lsj.value_and_grad(loss_fn, opt_state) with that model's opt_state." + off
            )
        warnings.warn(
            f"{where}: the gradients do not carry the loss scale of the optimizer state "
            "given to update, but another state's scale of this step. Right only if the two "
            "scales are equal (micro-batches of one accumulation window, taken with the "
            "window's first state); otherwise the updates are off by their ratio. " + _FIX + off,
            WiringWarning,
            stacklevel=5,
        )
        return
    if own:
        raise WiringError(
            f"{where}: the gradients given to update carry the optimizer state's loss scale "
            "to the power 0: they are not the backward pass of the loss lsj.scale_loss "
            "scaled in this step (lsj.scale_loss was called with this state, but the "
            "gradients were taken of another loss, never multiplied by the scale: the "
            "scaled loss only logged?), and update divides them by it: every update would "
            f"be too small by the scale ({_in_force(policy)}). " + _FIX + off
        )
    raise WiringError(
        f"{where}: the gradients given to update carry the optimizer state's loss scale to "
        "the power 0: they were computed in this step from a loss that was never multiplied "
        "by the scale, yet update divides them by it: every update would be too small by "
        f"the scale ({_in_force(policy)}), and training would crawl. " + _FIX + " A trainer "
        "that takes grad(loss) itself needs its integration (lossscale_jax.integrations)."
        + (_TUNIX if _tunix() else "")
        + off
    )


def _right(powers: _powers.Powers, leaves: list[Any]) -> bool:
    """Whether every leaf carries that analysis's scale once, through the backward pass."""
    return all(_leaf("", powers.value(g), True).verdict == RIGHT for g in leaves)


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
