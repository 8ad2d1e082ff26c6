"""Where the ``LossScaleState`` sits in an optimizer state, and the nestings refused.

``locate`` finds the one ``LossScaleState`` of an optimizer state and the state owning it
(``LossScalingState``/``LossScalingMultiStepsState``), walking the path from the root and
refusing every container on it that would let scaled gradients or skipped steps reach
training (``optax.chain`` with other transformations, Optax wrappers outside).
``refuse_nested_inner``/``refuse_nested_state`` refuse loss scaling nested in itself and
``optax.MultiSteps`` inside it, when a transformation is built or initialised.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import optax

from lossscale_jax.engine._engine import engine_of
from lossscale_jax.engine._opt_states import OWNER_TYPES
from lossscale_jax.engine._state import LossScaleState, is_loss_scale_state
from lossscale_jax.errors import NestingError, StateNotFoundError


def prepare_inner(inner: Any, where: str) -> optax.GradientTransformationExtraArgs:
    """``inner`` with extra-args support, after refusing what cannot be one.

    Raises ``TypeError`` for an object without ``init``/``update``, ``NestingError``
    for a loss-scaling transformation (it would unscale twice).
    """
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(
            f"inner must be an optax.GradientTransformation, got {type(inner).__name__}."
        )
    refuse_nested_inner(inner, where)
    return optax.with_extra_args_support(inner)


def refuse_nested_inner(inner: Any, where: str) -> None:
    """Refuses a loss-scaling transformation as the inner one (it would unscale twice)."""
    built = engine_of(inner)
    if built is not None:
        raise NestingError(
            f"{where}: inner is itself lossscale_jax.{built.engine.where}(...): the gradients "
            "would be unscaled twice and checked against the wrong scale. Use one loss-scaling "
            "transformation, outermost: lossscale_jax.loss_scaling(inner, policy) (or "
            "loss_scaling_multi_steps(inner, policy, every_k) to accumulate)."
        )


def _refuse_wrapped_init() -> None:
    """Refuses an ``init`` called by ``optax.MultiSteps.init``: the loss scaling is inside it.

    ``get_loss_scale_state`` refuses that nesting when the state is read, but a trainer that
    never calls ``scale_loss`` (its own accumulation wraps the optimizer it was given) would
    not read it. The few frames above ``init`` tell, when the state is built. Called from
    ``refuse_nested_state``, itself called by a front-end's ``init``.
    """
    frame = sys._getframe(3)
    for _ in range(_CALLERS):
        if frame is None:
            return
        if isinstance(frame.f_locals.get("self"), optax.MultiSteps):
            raise NestingError(_WRAPPED["MultiStepsState"])
        frame = frame.f_back


def refuse_nested_state(inner_state: Any, where: str) -> None:
    """Refuses an inner state that holds a loss-scale state or an optax.MultiSteps state, and
    an ``init`` called by ``optax.MultiSteps`` (the front-end's ``init`` calls this)."""
    _refuse_wrapped_init()

    def marked(x: Any) -> bool:
        return isinstance(x, LossScaleState | optax.MultiStepsState)

    for path, x in jax.tree_util.tree_flatten_with_path(inner_state, is_leaf=marked)[0]:
        at = jax.tree_util.keystr(path)
        if isinstance(x, LossScaleState):
            raise NestingError(
                f"{where}: inner holds another loss scaling (a LossScaleState at inner_state"
                f"{at}): the gradients would be unscaled twice and checked against the wrong "
                "scale. Use one loss-scaling transformation, outermost, with every other "
                "transformation inside it."
            )
        if isinstance(x, optax.MultiStepsState):
            raise NestingError(
                f"{where}: inner holds optax.MultiSteps (at inner_state{at}): the scale and "
                "the skip decision would change per micro-batch, inside the window, and an "
                "overflowing micro-batch would be dropped instead of skipping its window. "
                "Accumulate with lossscale_jax.loss_scaling_multi_steps(inner, policy, "
                "every_k=k)."
            )


# How many frames above a transformation's init refuse_wrapped_init looks at.
_CALLERS = 8

_INSIDE_CHAIN = (
    "lossscale_jax.loss_scaling is one of {n} transformations in an optax.chain (a tuple "
    "state): those before it see the scaled gradients (inf included; clipping them is wrong), "
    "those after it run on skipped steps (a schedule or Adam counts them, add_decayed_weights "
    "moves the parameters). Put them inside: lossscale_jax.loss_scaling(optax.chain(...), "
    "policy). (If this tuple is your own container, pass the loss-scaled optimizer's state "
    "itself.)"
)

# Optax wrappers around a loss scaling: why each is refused, and the fix.
_WRAPPED = {
    "MultiStepsState": (
        "lossscale_jax.loss_scaling is wrapped in optax.MultiSteps: it averages the scaled "
        "micro-gradients before the overflow check (a saturated 65504 becomes 65504/k and is "
        "missed) and resets its accumulator as (1 - emit) * acc, so one inf micro-batch leaves "
        "nan in it for good. Accumulate with lossscale_jax.loss_scaling_multi_steps(inner, "
        "policy, every_k=k)."
    ),
    "InjectHyperparamsState": (
        "lossscale_jax.loss_scaling is wrapped in optax.inject_hyperparams: its step count (and "
        "the schedules it evaluates) advances on skipped steps. Inject inside instead: "
        "lossscale_jax.loss_scaling(optax.inject_hyperparams(optax.adam)(learning_rate=...), "
        "policy)."
    ),
    "MaskedState": (
        "lossscale_jax.loss_scaling is wrapped in optax.masked: the leaves outside the mask "
        "get the raw scaled gradients (inf included). Mask inside instead: "
        "lossscale_jax.loss_scaling(optax.masked(inner, mask), policy)."
    ),
    "MultiTransformState": (
        "lossscale_jax.loss_scaling is wrapped in optax.multi_transform (or partition): the "
        "other labels' transformations get the raw scaled gradients and run on skipped steps. "
        "Partition inside instead: lossscale_jax.loss_scaling(optax.multi_transform(...), "
        "policy)."
    ),
    "ApplyIfFiniteState": (
        "lossscale_jax.loss_scaling is wrapped in optax.apply_if_finite: it sees the scaled "
        "gradients and counts its own errors on steps loss scaling already skips. Drop it "
        "(loss_scaling skips non-finite steps) or put it inside loss_scaling."
    ),
}
_WRAPPED["ConditionallyMaskState"] = _WRAPPED["ConditionallyTransformState"] = (
    "lossscale_jax.loss_scaling is wrapped in optax.conditionally_mask/conditionally_transform: "
    "its condition and step counter run on the scaled gradients and on skipped steps. Put it "
    "inside: lossscale_jax.loss_scaling(optax.conditionally_transform(...), policy)."
)
_WRAPPED["InjectStatefulHyperparamsState"] = _WRAPPED["InjectHyperparamsState"]
_WRAPPED["PartitionState"] = _WRAPPED["MultiTransformState"]


def _wrapped_message(node: Any) -> str:
    name = type(node).__name__
    if name in _WRAPPED:
        return _WRAPPED[name]
    return (
        f"lossscale_jax.loss_scaling is wrapped in an optax transformation whose state is "
        f"{name}: a wrapper outside loss scaling sees the scaled gradients and runs on skipped "
        "steps. Make loss_scaling the outermost transformation and put the wrapper inside it: "
        "lossscale_jax.loss_scaling(wrapper(...), policy)."
    )


def _children(node: Any) -> list[tuple[Any, Any]]:
    """``(key, child)`` one level down ``node`` (nothing for a leaf)."""
    flat = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
    return [(path[0], child) for path, child in flat if path]


def _check_path(root: Any, path: tuple) -> Any:
    """Walks ``path`` from ``root`` to a LossScaleState; returns the state owning it.

    Raises ``ValueError`` for every container on the way that is a refused
    nesting (see ``get_loss_scale_state``); the owner is ``None`` for a bare
    LossScaleState or one inside the user's own containers.
    """
    node, owner = root, None
    for key in path:
        if type(node) in OWNER_TYPES:
            owner = node
        elif type(node) is tuple and len(node) > 1:
            raise NestingError(_INSIDE_CHAIN.format(n=len(node)))
        elif type(node).__module__.split(".")[0] == "optax":
            raise NestingError(_wrapped_message(node))
        node = next(child for k, child in _children(node) if k == key)
    return owner


def locate(opt_state: Any) -> tuple[LossScaleState, Any]:
    """``(loss_scale_state, owner)``: the one LossScaleState and the state holding it.

    ``owner`` is the ``LossScalingState``/``LossScalingMultiStepsState`` whose
    ``loss_scale`` it is, or ``None`` for a bare ``LossScaleState``. Raises as
    ``get_loss_scale_state``.
    """
    if isinstance(opt_state, LossScaleState):
        return opt_state, None
    found = [
        (path, x)
        for path, x in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_loss_scale_state)[
            0
        ]
        if isinstance(x, LossScaleState)
    ]
    if not found:
        raise StateNotFoundError(
            "opt_state contains no LossScaleState: build the optimizer with "
            "lossscale_jax.loss_scaling(...) and pass its state (or the LossScaleState)."
        )
    if len(found) > 1:
        raise StateNotFoundError(
            f"opt_state contains {len(found)} LossScaleStates; pass the one you mean "
            "(e.g. get it from the inner state yourself)."
        )
    path, state = found[0]
    return state, _check_path(opt_state, path)
