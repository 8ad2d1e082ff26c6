# pyright: reportMissingImports=false
# (EasyDeL is an optional dependency: the type check runs without it installed.)
"""EasyDeL (``easydel``): its trainers in float16 with loss scaling, one call.

``pip install "lossscale_jax[easydel]"``; EasyDeL loads only when this module is imported.
Holds ``enable`` (public) and its parts: ``_seams`` (the names of EasyDeL it relies on),
``_step`` (the loss-scaled copy of an EasyDeL training step) and ``_sampling`` (its
compiled generation's draw from float32 logits). What it shares with the other
hosts (the compute-dtype switch, the check-then-apply refusal, the metrics) is in
``lossscale_jax.integrations._host``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections.abc import Iterator
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from lossscale_jax.engine._landing import float16_leaves
from lossscale_jax.errors import IntegrationError
from lossscale_jax.integrations._host import _changes, _dtype, _metrics
from lossscale_jax.integrations._host._changes import Change
from lossscale_jax.master import master_weights
from lossscale_jax.policies import LossScalePolicy
from lossscale_jax.transform import loss_scaling

try:
    from easydel.trainers import training_utils
    from easydel.trainers.base_trainer import BaseTrainer
    from flax import nnx
except ImportError as _missing:
    raise IntegrationError(
        "lossscale_jax.integrations.easydel needs EasyDeL: pip install "
        f"'lossscale_jax[easydel]' (easydel 0.3.0). ({_missing})"
    ) from _missing

from lossscale_jax.integrations.easydel import _sampling, _seams, _step

__all__ = ["TESTED_VERSIONS", "check_release", "enable"]

#: The easydel releases this integration was tested with. Another release is admitted when it
#: has every name the integration relies on (:func:`check_release`), with a warning.
TESTED_VERSIONS: tuple[str, ...] = _seams.TESTED
LOG = logging.getLogger("lossscale_jax.integrations.easydel")


def check_release(version: str | None = None) -> str:
    """The installed easydel release, if it has every name (module, class, method, field)
    the integration relies on; ``IntegrationError`` naming each one it lacks otherwise. A
    release other than :data:`TESTED_VERSIONS` that has them all is admitted with an
    ``IntegrationWarning``.

    Args:
      version: the release to name in the messages (default: the installed one's).

    Returns:
      The release.
    """
    return _seams.check(version)


def enable(
    trainer: Any,
    policy: LossScalePolicy | None = None,
    *,
    compute_dtype: Any = jnp.float16,
) -> Any:
    """Makes a built EasyDeL trainer train in float16 with loss scaling.

    Call it once, after the trainer is built (``SFTTrainer(...)``, ``GRPOTrainer(...)``)
    and before ``train``. Every check comes first: when ``enable`` refuses, nothing in the
    trainer, its model or the process has changed. Then:

    - ``compute_dtype`` (float16 by default): the model computes in it (every submodule's
      ``dtype``) with float32 parameters, and its norms in float32 (EasyDeL's ``RMSNorm``
      upcasts only float8 and float4: in float16 its backward pass overflows); the loss is
      computed in float32 (``LossConfig(compute_dtype="fp32")``: in float16 a sum past
      65,504 is inf). A trainer that samples (GRPO) samples from the switched model, its
      compiled generation from float32 logits (in float16, JAX's categorical draw never
      samples a token 9.2 nats below the top one: ``_sampling``);
    - the optimizer becomes ``lsj.loss_scaling(tx, policy)`` around the trainer's own
      (float16 parameters get float32 masters: ``lsj.master_weights``), its state
      initialised and sharded as EasyDeL shards it (``EasyDeLState.init_tx``); a state
      the trainer resumed carries over where it has the same structure;
    - the step (EasyDeL rebuilds it in ``configure_functions``, accumulation included)
      takes the gradients of the scaled loss, and an overflow skips the optimizer's update,
      the whole accumulation window's (the parameters and the optimizer's state as they
      were, the scale backed off; EasyDeL's own ``step`` counts it);
    - EasyDeL logs, beside its metrics: ``max_grad_norm``, ``mean_grad_norm`` and
      ``grad_norms`` unscaled, ``loss_scale/scale_used`` (the scale the step's loss was
      multiplied by), ``loss_scale/loss_scale`` (the scale after the step's adjustment: the
      next step's), ``loss_scale/skipped``, ``loss_scale/skipped_steps``,
      ``loss_scale/overflow_rate``; the first skipped step is also said in a log line of
      ``lossscale_jax.integrations.easydel`` (what was not finite: the loss, or the
      gradients and which leaf; what the policy did with its scale), and so is a run that
      no loss scale can fix (a non-finite loss, or a scale the policy does not lower, on 3
      steps in a row: stuck).

    Args:
      trainer: a built EasyDeL trainer whose step takes its gradients EasyDeL's way (its
        ``Trainer``, ``SFTTrainer``, ``GRPOTrainer`` and the others of ``easydel.trainers``).
      policy: the loss-scale policy. Default: ``lsj.DynamicScale()`` for float16 compute,
        ``lsj.NoScale(skip_on_overflow=True)`` (no loss scale, a non-finite step still
        skipped) for bfloat16 and float32 (given a scale anyway, it warns).
      compute_dtype: the dtype the model computes in; ``None`` leaves it as built.

    Returns:
      ``trainer``.

    Raises:
      IntegrationError: for an easydel release that lacks a name the integration relies on
        (naming it), an object that is not a built EasyDeL trainer, a trainer already
        enabled, one whose step takes its gradients otherwise, an optimizer that
        accumulates (``optax.MultiSteps``: EasyDeL accumulates in its step), or a model
        without a compute dtype whose parameters are not ``compute_dtype``.
    """
    _seams.check()
    if not isinstance(trainer, BaseTrainer):
        raise IntegrationError(
            f"enable() takes a built EasyDeL trainer (an easydel.trainers.BaseTrainer, such "
            f"as SFTTrainer or GRPOTrainer), got {type(trainer).__name__}."
        )
    lacks = _seams.instance_missing(trainer)
    if lacks:
        raise IntegrationError(
            f"enable(): this {type(trainer).__name__} lacks what the integration relies on: "
            f"{', '.join(lacks)}; build it before calling enable()."
        )
    changes = [_changes.refuse_twice(trainer, "easydel")]
    state = trainer.model_state
    model = state.model
    if compute_dtype is not None:
        changes.append(_dtype.compute_dtype_change(model, compute_dtype, "easydel"))
        changes.append(_loss_in_float32(trainer))
    dtype = compute_dtype if compute_dtype is not None else _dtype.compute_dtype_of(model)
    policy = _changes.default_policy(policy, dtype)
    changes.append(_optimizer_change(trainer, model, policy))
    if dtype is not None and jnp.finfo(dtype).bits < 32:
        changes.append(_sampling_change(trainer))
    changes.append(_step_change(trainer))
    _changes.apply(changes)
    return trainer


def _loss_in_float32(trainer: Any) -> Change:
    config = trainer.arguments.loss_config
    if isinstance(config, type) or not dataclasses.is_dataclass(config):
        raise IntegrationError(
            "enable(): this trainer's arguments.loss_config is not EasyDeL's LossConfig "
            f"(got {type(config).__name__}); the loss cannot be put in float32. Build the "
            "trainer with a LossConfig, or pass compute_dtype=None."
        )
    fp32 = dataclasses.replace(cast(Any, config), compute_dtype="fp32")  # made now: checked

    def change() -> None:
        trainer.arguments.loss_config = fp32

    return change


def _sampling_change(trainer: Any) -> Change:
    """The trainer's compiled generation sampling from float32 logits (``_sampling``)."""
    kwargs = trainer._default_generation_kwargs

    def change() -> None:
        trainer._default_generation_kwargs = _sampling.float32_sampling(kwargs)

    return change


def _optimizer_change(trainer: Any, model: Any, policy: LossScalePolicy) -> Change:
    """The loss-scaled optimizer, checked and built now, installed (with the model's new
    graph: its compute dtype) when the change is made."""
    state = trainer.model_state
    inner = state.tx if state.tx is not None else trainer.tx
    if isinstance(inner, optax.MultiSteps) or "MultiSteps" in type(inner).__qualname__:
        raise IntegrationError(
            "enable(): this trainer's optimizer accumulates (optax.MultiSteps), while "
            "EasyDeL accumulates in its step (gradient_accumulation_steps): the scaled "
            "gradients would be accumulated twice. Give the trainer the plain optimizer and "
            "set gradient_accumulation_steps."
        )
    if not isinstance(inner, optax.GradientTransformation):
        raise IntegrationError(
            f"enable(): this trainer has no Optax optimizer (model_state.tx is "
            f"{type(inner).__name__}); build it with one."
        )
    if float16_leaves(state.graphstate):
        inner = master_weights(inner)
    tx = loss_scaling(inner, policy)
    old_opt_state = state.opt_state

    def change() -> None:
        graphdef = nnx.graphdef(model)  # the compute dtype as switched
        new = state.replace(graphdef=graphdef, tx=None, opt_state=None).init_tx(tx)
        new = new.replace(opt_state=_carry_over(old_opt_state, new.opt_state))
        trainer.model_state = new
        trainer.state_shardings = new.shardings
        trainer.tx = tx
        trainer._model = nnx.eval_shape(lambda: new.model)

    return change


def _carry_over(plain: Any, scaled: Any) -> Any:
    """The loss-scaled state with the trainer's own state (resumed, or fresh) as its inner
    state, where they have the same structure."""
    inner = getattr(scaled, "inner_state", None)
    if plain is None or inner is None:
        return scaled
    if jax.tree_util.tree_structure(plain) != jax.tree_util.tree_structure(inner):
        return scaled
    placed = jax.tree_util.tree_map(lambda p, s: jax.device_put(p, s.sharding), plain, inner)
    return scaled._replace(inner_state=placed)


def _step_change(trainer: Any) -> Change:
    """The trainer's step functions rebuilt loss-scaled by its own ``configure_functions``,
    and what a skipped step was, said in a log line."""
    module = sys.modules[type(trainer).configure_functions.__module__]
    steps = {n: f for n, f in vars(module).items() if _seams.is_step(f)}
    if not steps:
        raise IntegrationError(
            f"enable(): {type(trainer).__qualname__}.configure_functions (in "
            f"{module.__name__}) builds no step that takes its gradients EasyDeL's way "
            "(jax.value_and_grad handed to minibatch_call, then update_state_respectfully): "
            "the integration cannot give it the loss scale. Train it without enable()."
        )

    leaves = _metrics.Leaves()

    def change() -> None:
        update = training_utils.update_metrics
        scaled = {n: _step.scaled_step(f, update, leaves) for n, f in steps.items()}
        # The generation functions too: EasyDeL keeps those it built (for the state's old
        # graph, the model's compute dtype and the optimizer's state) unless they are unset.
        trainer.generate_function = trainer.generate_function_with_model_kwargs = None
        with _rebound(module, scaled):
            trainer._configure_functions()
        _say_what_happened(trainer, leaves)

    return change


@contextlib.contextmanager
def _rebound(module: Any, names: dict[str, Any]) -> Iterator[None]:
    """``module``'s ``names`` rebound while ``configure_functions`` reads them."""
    saved = {n: getattr(module, n) for n in names}
    try:
        for n, f in names.items():
            setattr(module, n, f)
        yield
    finally:
        for n, f in saved.items():
            setattr(module, n, f)


def _say_what_happened(trainer: Any, leaves: _metrics.Leaves) -> None:
    """The trainer's ``apply_training_hooks`` (called each step with the step's metrics,
    which EasyDeL has already brought to the host), wrapped: what the step says of itself is
    taken out of the metrics EasyDeL logs, and the first skipped step and a stuck run are said
    in a log line (``_metrics.Teller``)."""
    teller = _metrics.Teller(LOG, f"the {type(trainer).__name__}", leaves)
    hooks = trainer.apply_training_hooks

    def apply_training_hooks(metrics: Any) -> Any:
        own = dict(metrics.other_metrics or {})
        why = own.pop(_step.WHY, None)
        if why is not None:
            teller.seen([why])
            metrics = metrics.replace(other_metrics=own)
        return hooks(metrics=metrics)

    trainer.apply_training_hooks = apply_training_hooks
