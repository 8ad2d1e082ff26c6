"""The loss-scaled optimizer ``enable`` gives a Tunix trainer, from the one the trainer holds.

A Tunix trainer holds ``nnx.Optimizer(model, tx, wrt=...)``. ``tx`` is the user's Optax
optimizer, wrapped by Tunix in ``optax.MultiSteps(tx, k)`` where the trainer's config sets
``gradient_accumulation_steps`` (google-tunix 0.1.7). A user may accumulate too, with an
``optax.MultiSteps`` of their own as the optimizer. ``loss_scaling`` refuses a
``MultiSteps`` inside it (its windows would take scaled gradients and skip per micro-batch),
so each ``MultiSteps`` is unwrapped here and its window kept as
``loss_scaling_multi_steps(inner, policy, every_k=k)``: the update every ``k``-th micro-batch,
a window with an overflow skipped whole. What cannot be kept exactly is refused, naming the
fix; nothing is dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lossscale_jax.accumulation import loss_scaling_multi_steps
from lossscale_jax.engine._landing import float16_leaves
from lossscale_jax.errors import IntegrationError
from lossscale_jax.master import master_weights
from lossscale_jax.policies import LossScalePolicy
from lossscale_jax.transform import loss_scaling


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the trainer's optimizer becomes: ``inner`` (the user's Optax optimizer, every
    ``MultiSteps`` unwrapped) updated every ``every_k`` micro-batches; ``layers``: how many
    ``MultiSteps`` states wrap ``inner``'s state in the trainer's optimizer state."""

    inner: Any
    every_k: int
    layers: int


def plan(tx: Any, tunix_k: int | None, *, wrapped: bool = True) -> Plan:
    """Unwraps ``tx``, the transformation a Tunix trainer's ``nnx.Optimizer`` holds;
    ``tunix_k``: the trainer's ``gradient_accumulation_steps`` (``None``: unset, and Tunix
    wrapped nothing); ``wrapped``: whether Tunix accumulates with an ``optax.MultiSteps``
    around ``tx`` (google-tunix 0.1.7) or with an accumulator of its own (its main branch:
    the window is the step's, and the plan's ``every_k`` is the user's alone)."""
    layers, every_k = 0, 1
    if not wrapped and tunix_k is not None and tunix_k > 1:
        every_k = tunix_k  # only to refuse a second window below; the step keeps Tunix's
    if wrapped and tunix_k is not None:
        if not isinstance(tx, optax.MultiSteps):
            raise IntegrationError(
                f"enable(): this trainer accumulates {tunix_k} micro-batches "
                "(gradient_accumulation_steps) but its optimizer is not the optax.MultiSteps "
                "google-tunix 0.1.7 wraps it in: this Tunix accumulates otherwise, and "
                "enable() would accumulate a second time. Install a tested release."
            )
        tx, layers, every_k = tx.inner_opt, 1, max(tunix_k, 1)
    tx = _multi_steps(tx) or tx
    if isinstance(tx, optax.MultiSteps):
        own = _constant_window(tx)
        if every_k > 1:
            raise IntegrationError(
                f"enable(): this trainer accumulates twice: Tunix's "
                f"gradient_accumulation_steps={tunix_k}, and its optimizer, an "
                f"optax.MultiSteps of its own (every_k_schedule={own or 'a schedule'}); stock "
                "Tunix updates the parameters once per both windows. Accumulate once: give "
                "the trainer the optimizer inside the MultiSteps (its inner_opt) and "
                f"gradient_accumulation_steps={(tunix_k or 1) * own if own else 'the product'} "
                "(Tunix counts a train step per window: max_steps and the checkpoint and "
                "eval cadences count those)."
            )
        tx, layers, every_k = tx.inner_opt, layers + 1, _keepable(tx, own)
    elif not wrapped:
        every_k = 1
    return Plan(tx, every_k, layers)


def _multi_steps(tx: Any) -> optax.MultiSteps | None:
    """The ``optax.MultiSteps`` inside ``tx`` where ``tx`` is one wrapped by another's
    ``inner_opt`` (``optax.with_extra_args_support``: its ``init`` is the MultiSteps' own)."""
    owner = getattr(getattr(tx, "init", None), "__self__", None)
    return owner if isinstance(owner, optax.MultiSteps) else None


def _constant_window(tx: optax.MultiSteps) -> int | None:
    """The window of a ``MultiSteps`` built with an int ``every_k_schedule`` (optax keeps it
    as ``lambda step: k``); ``None`` for a schedule."""
    schedule = tx._every_k_schedule
    if getattr(schedule, "__qualname__", "").startswith("MultiSteps.__init__"):
        cells = [c.cell_contents for c in schedule.__closure__ or ()]
        if len(cells) == 1 and isinstance(cells[0], int):
            return cells[0]
    return None


def _keepable(tx: optax.MultiSteps, own: int | None) -> int:
    """The window of the user's ``MultiSteps``; refuses what a ``loss_scaling_multi_steps``
    window would not keep of it, naming the fix."""
    if own is None:
        raise IntegrationError(
            "enable(): this trainer's optimizer is an optax.MultiSteps whose every_k_schedule "
            "is a schedule; enable() keeps a window of a fixed size (the update every k-th "
            "micro-batch, an overflowing window skipped whole). Give it an int "
            "(optax.MultiSteps(opt, every_k_schedule=k)), or set Tunix's "
            "gradient_accumulation_steps=k and pass the optimizer alone."
        )
    if not tx._use_grad_mean:
        raise IntegrationError(
            "enable(): this trainer's optimizer is optax.MultiSteps(..., use_grad_mean=False) "
            "(the window's sum); enable()'s window applies the mean. Keep the mean "
            f"(use_grad_mean=True) and scale the learning rate by {own}, or put "
            f"optax.scale({own}) first in the inner optimizer (the sum exactly)."
        )
    rule = tx._should_skip_update_fn
    if not getattr(rule, "__qualname__", "").startswith("MultiSteps.__init__"):  # optax's none
        raise IntegrationError(
            "enable(): this trainer's optimizer is optax.MultiSteps(..., "
            "should_skip_update_fn=...); enable()'s window skips a micro-batch whose "
            "gradients are not finite (the whole window) and has no place for another rule. "
            "Drop should_skip_update_fn, or train without enable()."
        )
    return own


def build(
    model: Any, old: Any, the_plan: Plan, policy: LossScalePolicy, optimizer_cls: type
) -> Any:
    """The loss-scaled ``optimizer_cls`` (``lsj.LossScaleOptimizer``) of ``model`` with the
    plan's inner optimizer and window, master weights for float16 parameters, and the state
    of ``old`` (a trainer's plain optimizer, maybe restored from a checkpoint) carried over."""
    inner = the_plan.inner
    master = bool(float16_leaves(nnx.as_pure(nnx.state(model, old.wrt))))
    if master:
        inner = master_weights(inner)
    if the_plan.every_k > 1:
        tx = loss_scaling_multi_steps(inner, policy, every_k=the_plan.every_k)
    else:
        tx = loss_scaling(inner, policy)
    new = optimizer_cls(model, tx, wrt=old.wrt)
    if not master:
        _carry_over(old, new, the_plan.layers)
    return new


def _carry_over(old: Any, new: Any, layers: int) -> None:
    """The plain optimizer's state (Tunix may have restored it from a checkpoint) into the
    loss-scaled one's inner state, and its step, where they have the same structure. A
    window in progress (the user's ``MultiSteps`` restored mid-window) carries its
    micro-batches seen and their sum."""
    if not int(np.asarray(old.step[...])):
        return  # a fresh optimizer: nothing to carry
    plain = nnx.as_pure(old.opt_state)
    windows = []
    for _ in range(layers):
        windows.append(plain)
        plain = plain.inner_opt_state
    state = nnx.as_pure(new.opt_state)
    if jax.tree_util.tree_structure(plain) != jax.tree_util.tree_structure(state.inner_state):
        return
    state = state._replace(inner_state=plain)
    if windows and hasattr(state, "acc_grads"):
        last = windows[-1]  # the innermost window: the one the loss-scaled window replaces
        seen = int(np.asarray(last.mini_step))
        if seen:
            total = jax.tree_util.tree_map(  # MultiSteps keeps the mean, the window the sum
                lambda acc, mean: (np.asarray(mean, np.float64) * seen).astype(acc.dtype),
                state.acc_grads,
                last.acc_grads,
            )
            state = state._replace(mini_step=jnp.asarray(seen, jnp.int32), acc_grads=total)
    nnx.update(new.opt_state, nnx.state(state))
    new.step[...] = old.step[...]
