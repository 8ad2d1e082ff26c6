# pyright: reportMissingImports=false
# (MaxText is an optional dependency: the type check runs without it installed.)
"""MaxText's post-training on Tunix: its models' compute dtype, its SFT trainer's own step.

MaxText (``maxtext`` on PyPI; 0.2.5 tested) trains on Tunix's trainers two ways: SFT with
``MaxTextPeftTrainer`` on its ``Transformer``; RL and DPO with Tunix's learners and
``DPOTrainer`` on ``TunixMaxTextAdapter``, which wraps the Transformer as ``base``
(``from_pretrained(..., wrap_with_tunix_adapter=True)``). Nothing here imports MaxText: a
model or trainer of MaxText's exists only where the program has imported MaxText, and is
found through ``sys.modules``.

The compute dtype. A MaxText Transformer computes in its config's ``dtype`` (its parameters
are ``weight_dtype``): its layers copied that dtype when they were built (as ``dtype``, and
where MaxText derives one from it, ``attend_dtype``, ``fprop_dtype``), and read
``config.dtype`` when called; the config is read-only. :func:`compute_dtype_change` asks
MaxText what it builds for another dtype, changing nothing: the config copied with that
``dtype`` (``model_copy(update=...)``, as MaxText's ``from_pretrained`` copies one), an
abstract model built from it (``create_nnx_abstract_model``: shapes, no arrays), and the
dtypes its layers hold where they differ from the built model's. The change sets those
dtypes and the new config on the built model (its parameters stay as they are). Where that
cannot be done exactly (a quantized model; a layer holding the old config or dtype in a
function; a layer MaxText's build does not make), it refuses, saying what to set instead:
MaxText's ``dtype`` when the model is built.

The step. ``MaxTextPeftTrainer`` overrides ``create_train_step_fn`` with a step of its own:
``jax.value_and_grad`` over an explicit ``nnx.split``/``merge`` (Tunix's ``nnx.value_and_grad``
inside ``nnx.jit`` trips MaxText's graph), the non-parameter state carried out of it, and a
branch for Tunix's gradient accumulator. :func:`own_step` keeps that step: MaxText's method
builds it, with the loss it differentiates scaled (``lsj.scale_loss`` with the optimizer the
step is given) and the loss-scaled optimizer's ``update``; the loss and the gradient norm it
returns are unscaled for the log. Its accumulation branch takes Tunix's ``grad_accumulator``,
which google-tunix 0.1.7's trainer does not pass (the step fails there without ``enable``
too): ``gradient_accumulation_steps`` > 1 is refused, naming the setting.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lossscale_jax.access._access import get_loss_scale_state, scale_loss
from lossscale_jax.engine._unscale import inverse
from lossscale_jax.errors import IntegrationError
from lossscale_jax.integrations.tunix._step import outputs

Change = Callable[[], None]

_TRANSFORMER = ("maxtext.models.models", "Transformer")
_SFT_TRAINER = ("maxtext.trainers.post_train.sft.train_sft", "MaxTextPeftTrainer")
_CREATION = "maxtext.utils.model_creation_utils"
_PYCONFIG = "maxtext.configs.pyconfig"


def _loaded(where: tuple[str, str]) -> Any:
    """``module.name`` where the program has imported ``module``; else ``None``."""
    module = sys.modules.get(where[0])
    return getattr(module, where[1], None) if module is not None else None


def transformers(model: Any) -> list[Any]:
    """The MaxText Transformers in ``model``'s graph: ``model`` itself, or the one a
    ``TunixMaxTextAdapter`` (or another wrapper) holds; ``[]`` for any other model."""
    cls = _loaded(_TRANSFORMER)
    if cls is None:
        return []
    return [m for _, m in nnx.iter_graph(model) if isinstance(m, cls)]


def compute_dtype_of(model: Any) -> np.dtype | None:
    """The dtype a MaxText model computes in (its config's ``dtype``); ``None`` for a model
    that is not MaxText's."""
    found = transformers(model)
    return np.dtype(found[0].config.dtype) if found else None


def compute_dtype_change(model: Any, dtype: Any) -> Change | None:
    """What makes a MaxText model compute in ``dtype``, checked now and done when called
    (see the module's docstring); ``None`` for a model that is not MaxText's. Raises
    ``IntegrationError``, having changed nothing, where it cannot be done exactly."""
    found = transformers(model)
    if not found:
        return None
    changes = [_switch(transformer, np.dtype(dtype)) for transformer in found]

    def change() -> None:
        for module, name, value in (s for sets in changes for s in sets):
            setattr(module, name, value)

    return change


def _refusal(config: Any, dtype: np.dtype, why: str) -> IntegrationError:
    return IntegrationError(
        f"lossscale_jax.integrations.tunix: this MaxText model computes in its config's "
        f"dtype, {np.dtype(config.dtype).name}, and enable() cannot switch it to "
        f"{dtype.name}: {why}. Build the model with MaxText's dtype={dtype.name} (its "
        f"weight_dtype stays {np.dtype(config.weight_dtype).name}): dtype={dtype.name} on "
        f"MaxText's command line, or pyconfig.initialize(..., dtype='{dtype.name}'); then "
        "enable() finds it computing in that dtype and changes nothing in it."
    )


def _switch(transformer: Any, dtype: np.dtype) -> list[tuple[Any, str, Any]]:
    """The ``(module, attribute, value)`` that make ``transformer`` compute in ``dtype`` as
    MaxText would have built it; ``[]`` when it already does."""
    config = transformer.config
    if np.dtype(config.dtype) == dtype:
        return []
    if getattr(config, "quantization", None):
        raise _refusal(config, dtype, f"it is quantized ({config.quantization!r})")
    pyconfig, creation = importlib.import_module(_PYCONFIG), importlib.import_module(_CREATION)
    try:  # what MaxText 0.2.5 has: its config's pydantic model, its abstract build
        pydantic = config._pydantic_config
        kind: Any = type(pydantic.dtype)  # MaxText's DType enum
        build = creation.create_nnx_abstract_model
        mesh, mode = transformer.mesh, transformer.model_mode
    except AttributeError as e:
        raise _refusal(config, dtype, f"this MaxText lacks what the switch reads ({e})") from e
    if dtype.name not in {member.value for member in kind}:
        raise _refusal(config, dtype, "MaxText's config has no such dtype")
    new_config = pyconfig.HyperParameters(pydantic.model_copy(update={"dtype": kind(dtype.name)}))
    _, built = build(new_config, mesh=mesh, model_mode=mode)
    if type(built) is not type(transformer):
        raise _refusal(config, dtype, f"MaxText builds a {type(built).__name__} for it")
    rebuilt = {path: m for path, m in nnx.iter_graph(built) if isinstance(m, nnx.Module)}
    old_dtype = np.dtype(config.dtype)
    sets = []
    for path, module in nnx.iter_graph(transformer):
        if not isinstance(module, nnx.Module):
            continue
        twin = rebuilt.get(path)
        where = "/".join(map(str, path)) or "the model"
        for name, held in vars(module).items():
            if held is config:
                sets.append((module, name, new_config))
            elif _dtype(held) is not None:
                want = _dtype(getattr(twin, name, None))
                if twin is None and _dtype(held) == old_dtype:
                    raise _refusal(config, dtype, f"MaxText's build has no layer at {where}")
                if want is not None and want != _dtype(held):
                    sets.append((module, name, want))
            elif any(c is config or _dtype(c) == old_dtype for c in _cells(held)):
                raise _refusal(
                    config, dtype, f"{where}.{name} holds its {old_dtype.name} in a function"
                )
    return sets


def _dtype(value: Any) -> np.dtype | None:
    """``value`` as a floating dtype, where it is one (``np.dtype``, ``np.float16``,
    ``jnp.float32``); else ``None`` (an array has a dtype, and is not one)."""
    if isinstance(value, np.dtype):
        found = value
    elif isinstance(value, type) and issubclass(value, np.generic):
        found = np.dtype(value)
    elif isinstance(value, type) and isinstance(getattr(value, "dtype", None), np.dtype):
        found = value.dtype  # jnp.float32 and its kind: a scalar type
    else:
        return None
    return found if jnp.issubdtype(found, jnp.floating) else None


def _cells(value: Any) -> list[Any]:
    """What a function attribute holds: a partial's arguments, a closure's cells."""
    if isinstance(value, functools.partial):
        return [*value.args, *value.keywords.values()]
    closure = getattr(value, "__closure__", None) if callable(value) else None
    cells = []
    for cell in closure or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return cells


def own_step(trainer: Any, peft_trainer_cls: type) -> Callable[[], Callable[..., Any]] | None:
    """For ``MaxTextPeftTrainer`` (its own step, as MaxText defines it): the trainer's new
    ``create_train_step_fn``, which builds MaxText's step loss-scaled (see the module's
    docstring); ``None`` for any other trainer, or a subclass that overrides the step again
    (the caller refuses those by name). Raises ``IntegrationError`` where MaxText's step
    cannot be kept."""
    cls = _loaded(_SFT_TRAINER)
    if cls is None or not isinstance(trainer, cls):
        return None
    kind = type(trainer)
    if (
        kind.create_train_step_fn is not cls.create_train_step_fn
        or kind._train_step is not peft_trainer_cls._train_step
    ):
        return None
    every_k = trainer.config.get_with_default("gradient_accumulation_steps", 1) or 1
    if every_k > 1:
        raise IntegrationError(
            f"enable(): {kind.__name__}'s own train step accumulates gradients through "
            "Tunix's grad_accumulator, which this google-tunix trainer does not pass (the "
            "step fails there without enable() too: 'NoneType' object has no attribute "
            f"'add'). Train it with gradient_accumulation_steps=1 (it has {every_k}), "
            "MaxText's gradient_accumulation_steps=1."
        )
    create = cls.create_train_step_fn

    def create_train_step_fn() -> Callable[..., Any]:
        return _scaled_step(trainer, create)

    return create_train_step_fn


@dataclasses.dataclass
class _Tracing:
    """The optimizer of the step being traced (the scaled loss reads its scale)."""

    optimizer: Any = None


def _scaled_step(trainer: Any, create: Callable[[Any], Any]) -> Callable[..., Any]:
    """MaxText's step, built by its own ``create`` with the trainer's loss scaled; the step
    returns ``(loss, aux, grad_norm)`` unscaled, aux as ``_step.outputs`` packs it."""
    plain, has_aux = trainer.loss_fn, trainer._has_aux
    tracing = _Tracing()

    def scaled_loss(model: Any, **inputs: Any) -> tuple[Any, Any]:
        out = plain(model, **inputs)
        loss, aux = out if has_aux else (out, None)
        return scale_loss(loss, tracing.optimizer.opt_state), {"loss": loss, "aux": aux}

    # MaxText's create_train_step_fn reads the loss and has_aux when it builds the step.
    trainer.loss_fn, trainer._has_aux = scaled_loss, True
    try:
        step = create(trainer)
    finally:
        trainer.loss_fn, trainer._has_aux = plain, has_aux

    def train_step(model: Any, optimizer: Any, inputs: Any) -> tuple[Any, Any, Any]:
        scale = jnp.asarray(get_loss_scale_state(optimizer.opt_state).scale)
        tracing.optimizer = optimizer
        try:
            _, out, scaled_norm = step(model, optimizer, inputs)
        finally:
            tracing.optimizer = None
        grad_norm = scaled_norm.astype(jnp.float32) * inverse(scale)
        return outputs(out["loss"], out["aux"], grad_norm, optimizer, scale)

    return train_step
