# pyright: reportMissingImports=false
# (EasyDeL is an optional dependency: the type check runs without it installed.)
"""The names of EasyDeL the integration relies on, checked by name (not by version string).

Every EasyDeL trainer builds its step in ``configure_functions`` from a step function of its
own ``_fn`` module, and every one of those (17 in 0.3.0) takes its gradients the same way::

    gradients, metrics = minibatch_call(state=state, batch=batch, minibatch_size=...,
                                        grad_fn=jax.value_and_grad(loss_fn, has_aux=True))
    state = update_state_respectfully(state=state, gradients=gradients, ...,
                                      metrics=update_metrics(metrics=metrics, ...))

which is the seam: a step function whose code names ``jax.value_and_grad``,
``minibatch_call`` and ``update_state_respectfully`` (:func:`is_step`).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import types
import warnings
from typing import Any

from lossscale_jax.errors import IntegrationError, IntegrationWarning

TESTED = ("0.3.0",)
STEP_NAMES = frozenset({"jax", "value_and_grad", "minibatch_call", "update_state_respectfully"})

# module -> the names in it the integration calls or reads.
NAMES = {
    "easydel.trainers.training_utils": ("minibatch_call", "update_state_respectfully"),
    "easydel.trainers.base_trainer": ("BaseTrainer",),
    "easydel.infra.base_state": ("EasyDeLState",),
    "easydel.infra.loss_utils": ("LossConfig", "LossMetrics"),
    "easydel.inference.logits_process": ("LogitsProcessor", "LogitsProcessorList"),
    "easydel.infra.mixins.generation": ("EasyGenerationMixin",),
}
# class (module, name) -> its members the integration uses.
MEMBERS = {
    ("easydel.trainers.base_trainer", "BaseTrainer"): (
        "configure_functions",
        "_configure_functions",
        "apply_training_hooks",
        "_default_generation_kwargs",
    ),
    ("easydel.infra.base_state", "EasyDeLState"): ("init_tx", "replace", "model", "shardings"),
}
FIELDS = {
    ("easydel.infra.loss_utils", "LossConfig"): ("compute_dtype",),
    ("easydel.infra.loss_utils", "LossMetrics"): (
        "other_metrics",
        "max_grad_norm",
        "mean_grad_norm",
        "grad_norms",
    ),
}
INSTANCE = (
    "model_state",
    "arguments",
    "state_shardings",
    "tx",
    "generate_function",
    "generate_function_with_model_kwargs",
)


def missing() -> list[str]:
    """Each name the integration relies on that the installed EasyDeL lacks."""
    out = []
    modules = {}
    for name, attrs in NAMES.items():
        try:
            modules[name] = importlib.import_module(name)
        except ImportError as e:
            out.append(f"module {name} ({e})")
            continue
        out += [f"{name}.{a}" for a in attrs if not hasattr(modules[name], a)]
    for (module, cls), members in {**MEMBERS, **FIELDS}.items():
        owner = getattr(modules.get(module), cls, None)
        if owner is None:
            continue
        known = set(dir(owner)) | set(getattr(owner, "__dataclass_fields__", {}))
        known |= set(getattr(owner, "__annotations__", {}))
        out += [f"{module}.{cls}.{m}" for m in members if m not in known]
    utils = modules.get("easydel.trainers.training_utils")
    call = getattr(utils, "minibatch_call", None)
    if call is not None and "grad_fn" not in inspect.signature(call).parameters:
        out.append("easydel.trainers.training_utils.minibatch_call(grad_fn=...)")
    mixin = getattr(modules.get("easydel.infra.mixins.generation"), "EasyGenerationMixin", None)
    generate = getattr(mixin, "generate", None)
    if generate is not None and "logits_processor" not in inspect.signature(generate).parameters:
        out.append(
            "easydel.infra.mixins.generation.EasyGenerationMixin.generate(logits_processor=...)"
        )
    return out


def check(version: str | None = None) -> str:
    """The installed EasyDeL release if it has every name in :data:`NAMES`, :data:`MEMBERS`
    and :data:`FIELDS`; ``IntegrationError`` naming those it lacks otherwise. A release not
    in :data:`TESTED` that has them all is admitted with an ``IntegrationWarning``."""
    version = version or importlib.metadata.version("easydel")
    lacks = missing()
    if lacks:
        raise IntegrationError(
            f"lossscale_jax.integrations.easydel: easydel {version} lacks what the "
            f"integration relies on: {'; '.join(lacks)}. Install easydel {TESTED[-1]}."
        )
    if version not in TESTED:
        warnings.warn(
            f"lossscale_jax.integrations.easydel was tested with easydel {', '.join(TESTED)}, "
            f"not {version}; it has every name the integration relies on, so it is used.",
            IntegrationWarning,
            stacklevel=3,
        )
    return version


def is_step(fn: Any) -> bool:
    """Whether ``fn`` is a training step EasyDeL's way (see the module's docstring)."""
    return isinstance(fn, types.FunctionType) and STEP_NAMES <= set(fn.__code__.co_names)


def instance_missing(trainer: Any) -> list[str]:
    """The attributes of a built trainer the integration reads that ``trainer`` lacks."""
    return [f"trainer.{a}" for a in INSTANCE if not hasattr(trainer, a)]
