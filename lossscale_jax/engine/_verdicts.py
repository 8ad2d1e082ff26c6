"""What the wiring check found, and how it says it: a gradient leaf's verdict from the powers
of the scale it carries (``_powers``), and the messages of ``WiringError`` and
``WiringWarning``, each naming what the analysis found, its direction, the fix, and the two
switches that turn the check off.

A leaf's alternatives (a select picks one) are each classified (``kind``): ``right`` (the
scale to the power 1, through the backward pass), ``after`` (power 1, some of it after the
backward pass), ``free`` (power 0, never reached), ``cancelled`` (power 0, divided out),
``large`` / ``small`` (power >= 2 / < 1), ``mixed`` (a sum of powers), ``unknown``. A zero
alternative is every power at once and is left out. The leaf is ``right`` when every
alternative is, wrong (the worst kind) when every alternative is wrong, else ``warn``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from fractions import Fraction
from typing import Any

from lossscale_jax.engine import _powers

FIX = (
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


def off(where: str) -> str:
    """How to turn the check off, as every message says it."""
    one = (
        f"{where}(..., check_wiring=False) for this transformation, or "
        if where in SWITCHED
        else ""
    )
    return (
        f" If the step is right, turn the check off: {one}trace the step inside `with "
        "lsj.no_wiring_check():` (docs/errors.md, the wiring check)."
    )


# -- what one leaf carries -------------------------------------------------------------------

RIGHT, AFTER, FREE, CANCELLED, LARGE, SMALL, MIXED, UNKNOWN, OUTSIDE = (
    "right", "after", "free", "cancelled", "large", "small", "mixed", "unknown", "outside",
)  # fmt: skip
WRONG = frozenset({FREE, CANCELLED, LARGE, SMALL, MIXED})


def kind(alt: _powers.Alt) -> tuple[str, _powers.Power]:
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
class Leaf:
    path: str
    verdict: str  # RIGHT, a kind of WRONG (every alternative wrong), "warn"
    kinds: tuple[tuple[str, _powers.Power], ...]
    backward: bool
    powers: tuple[_powers.Power, ...] = ()  # every power a term of the leaf carries
    zero: bool = False  # zero in every form: right, and no sign of any scale


def leaf(path: str, value: _powers.Value, backward: bool) -> Leaf:
    if value is None:
        return Leaf(path, "warn", ((UNKNOWN, Fraction(0)),), backward)
    # A zero alternative is every power at once (a where that zeroes a leaf, an unscaling
    # by a bad scale's nan): it neither proves nor disproves the others. So is a term that
    # is an input of the step (an accumulator carried in): its power is not known.
    alts = [frozenset(t for t in alt if t[1] != _powers.IN) for alt in value if alt]
    if not any(alts):
        zero = not alts  # else every form is an input of the step, moved: not seen
        return Leaf(path, RIGHT if zero else OUTSIDE, ((RIGHT, Fraction(1)),), backward, (), zero)
    kinds = tuple(sorted({kind(alt) for alt in alts if alt}, key=str))
    names = {n for n, _ in kinds}
    powers = tuple(sorted({k for alt in alts for k, _ in alt}))
    if names == {RIGHT}:
        return Leaf(path, RIGHT, kinds, backward, powers)
    wrong = [n for n, _ in kinds if n in WRONG]
    if len(wrong) == len(kinds):
        order = (MIXED, LARGE, SMALL, CANCELLED, FREE)
        return Leaf(path, next(n for n in order if n in names), kinds, backward, powers)
    return Leaf(path, "warn", kinds, backward, powers)


def found(leaf: Leaf, share: str, policy: Any) -> str:
    """What the analysis found, for a leaf wrong in every alternative."""
    k = next((k for n, k in leaf.kinds if n == leaf.verdict), Fraction(0))
    scale = in_force(policy)
    if leaf.verdict == LARGE:
        by = "the scale" if k == 2 else f"the scale to the power {k - 1}"
        return (
            f"the gradients given to update carry the optimizer state's loss scale to the "
            f"power {k} ({share}): the loss was multiplied by it more than once before the "
            "backward pass (lsj.scale_loss and a multiplication by the scale by hand, the "
            "gradients multiplied by it after jax.grad, or lsj.scale_loss of a value that "
            f"already holds it), so every update would be too large by {by} ({scale}"
            + (
                ", e.g. 256 times once it is 2**8"
                if k == 2 and policy.constant_scale is None
                else ""
            )
            + "). Scale the loss once: lsj.scale_loss(loss, opt_state) of the plain loss, "
            "or lsj.value_and_grad(loss_fn, opt_state)."
        )
    if leaf.verdict == SMALL:
        return (
            f"the gradients given to update carry the optimizer state's loss scale to the "
            f"power {k} ({share}): the scale was divided out more often than it was "
            "multiplied in (a scaled loss divided by the scale, or gradients unscaled by "
            f"hand), so every update would be too small by the scale to the power {1 - k} "
            f"({scale}). " + FIX
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


def uncertain(leaf: Leaf, policy: Any) -> str:
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
            "there are lost: loss scaling does not do its work. " + FIX
        )
    found = ", ".join(f"{n} (power {k})" if n not in (RIGHT, UNKNOWN) else n for n, k in leaf.kinds)
    clip = (
        " Unscaled gradients clipped at max_norm * scale give these two forms: clip inside the "
        "loss scaling, on the unscaled gradients: "
        "lsj.loss_scaling(optax.chain(optax.clip_by_global_norm(max_norm), inner), policy)."
        if names >= {FREE, AFTER}
        else ""
    )
    return (
        f"the gradient leaf at {leaf.path} takes one of several forms (a select, a max, a "
        f"branch or a loop picks between them): {found}. Only a form that carries the loss "
        "scale once, through the backward pass, gives the right update; the check cannot "
        f"tell which form a step takes ({in_force(policy)}). " + FIX + clip
    )


def in_force(policy: Any) -> str:
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


def frozen(where: str, value: float) -> str:
    return (
        f"{where}: lsj.scale_loss multiplied the loss by a loss scale that is a constant "
        f"of this traced step ({value:g}), while update divides by the scale of the "
        "optimizer state the step receives: the loss would keep the scale of the step "
        "that was traced whatever the state holds later, and the updates would be off by "
        "their ratio. Give scale_loss the optimizer state (or NNX optimizer) the step "
        "receives as an argument, not one captured from outside it (a closure over the "
        "optimizer object or a global)." + off(where)
    )


def swapped(where: str) -> str:
    return (
        f"{where}: the gradients given to update are scaled by another optimizer "
        "state's loss scale, while this state's scale scaled another loss of the "
        "same step: the two states are swapped (each loss scaled with the other "
        "model's state), so each update would be off by the ratio of the two "
        "scales, and each scale would back off for the other model's overflows. "
        "Scale each loss with the optimizer state of the parameters it updates: "
        "lsj.value_and_grad(loss_fn, opt_state) with that model's opt_state." + off(where)
    )


def other_state(where: str) -> str:
    return (
        f"{where}: the gradients do not carry the loss scale of the optimizer state "
        "given to update, but another state's scale of this step. Right only if the two "
        "scales are equal (micro-batches of one accumulation window, taken with the "
        "window's first state); otherwise the updates are off by their ratio. " + FIX + off(where)
    )


def logged_only(where: str, policy: Any) -> str:
    return (
        f"{where}: the gradients given to update carry the optimizer state's loss scale "
        "to the power 0: they are not the backward pass of the loss lsj.scale_loss "
        "scaled in this step (lsj.scale_loss was called with this state, but the "
        "gradients were taken of another loss, never multiplied by the scale: the "
        "scaled loss only logged?), and update divides them by it: every update would "
        f"be too small by the scale ({in_force(policy)}). " + FIX + off(where)
    )


def never_scaled(where: str, policy: Any) -> str:
    return (
        f"{where}: the gradients given to update carry the optimizer state's loss scale to "
        "the power 0: they were computed in this step from a loss that was never multiplied "
        "by the scale, yet update divides them by it: every update would be too small by "
        f"the scale ({in_force(policy)}), and training would crawl. " + FIX + " A trainer "
        "that takes grad(loss) itself needs its integration (lossscale_jax.integrations)."
        + (_TUNIX if "tunix" in sys.modules else "")
        + off(where)
    )


def scaled_twice() -> str:
    return (
        "lsj.value_and_grad: the loss function already multiplies its loss by the optimizer "
        "state's loss scale (it calls lsj.scale_loss, or multiplies by the scale by hand), "
        "and value_and_grad scales it again: the gradients would be scaled twice, and every "
        "update would be too large by the loss scale (the scale backs off and then applies "
        "them). Return the plain loss from the loss function: value_and_grad scales it."
        + off("loss_scaling")
    )
