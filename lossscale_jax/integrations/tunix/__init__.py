# pyright: reportMissingImports=false
# (Tunix is an optional dependency: the type check runs without it installed.)
"""Tunix (``google-tunix``): its SFT and RL trainers in float16 with loss scaling, one call.

``pip install "lossscale_jax[tunix]"``; Tunix loads only when this package is imported. Its
parts are listed in ``lossscale_jax.integrations``; what they share with the other hosts is
in ``lossscale_jax.integrations._host``.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from lossscale_jax.errors import IntegrationError
from lossscale_jax.policies import LossScalePolicy

try:
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl import rl_learner
    from tunix.rl import trainer as rl_trainer
    from tunix.sft import peft_trainer
except ImportError as _missing:  # the floor CI leg checks the message
    raise IntegrationError(
        "lossscale_jax.integrations.tunix needs Tunix: pip install 'lossscale_jax[tunix]' "
        f"(google-tunix 0.1.7). ({_missing})"
    ) from _missing

from lossscale_jax.flax_utils import LossScaleOptimizer
from lossscale_jax.integrations._host import _changes
from lossscale_jax.integrations._host._changes import Change
from lossscale_jax.integrations.tunix import (
    _accumulating_step,
    _checkpoint,
    _lora,
    _maxtext,
    _mismatch,
    _models,
    _optimizer,
    _seams,
)
from lossscale_jax.integrations.tunix._step import make_train_step, route_metrics

__all__ = ["TESTED_VERSIONS", "check_release", "enable"]

#: The google-tunix releases this integration was tested with. Another release is admitted
#: when it has every name the integration relies on (:func:`check_release`), with a warning.
TESTED_VERSIONS: tuple[str, ...] = _seams.TESTED


def check_release(version: str | None = None) -> str:
    """The installed google-tunix release, if it has every name (module, class, method,
    signature, field) the integration relies on; ``IntegrationError`` naming each one it
    lacks or changed otherwise. A release other than :data:`TESTED_VERSIONS` that has them
    all is admitted with an ``IntegrationWarning``.

    Args:
      version: the release to name in the messages (default: the installed one's).

    Returns:
      The release.
    """
    return _seams.check(version)


def enable(
    target: Any,
    policy: LossScalePolicy | None = None,
    *,
    critic_policy: LossScalePolicy | None = None,
    compute_dtype: Any = jnp.float16,
    rollout_mismatch: bool | None = None,
) -> Any:
    """Makes a Tunix trainer (or an RL learner's trainers) train in float16 with loss scaling.

    Call it once, after the trainer is built with a plain Optax optimizer (as Tunix's docs
    build it), or after the RL learner is built (it sets its own loss on the actor's trainer),
    and before ``train``. Every check comes first: when ``enable`` refuses, nothing in the
    trainers, the models or the process has changed. For each trainer (the actor's, and the
    critic's under PPO):

    - ``compute_dtype`` (float16 by default): the model computes in it (its ``config.dtype``
      and every submodule's; a model without one must hold parameters of that dtype), and
      so does the rollout that samples from it; every Tunix model's attention mask constant
      is made finite in it (``-2.38e38`` is ``-inf`` in float16: a fully padded row would be
      nan), and a LoRA (qwix's, on any projection) computes in it, as the projection it
      adapts does (a float32 LoRA output would meet the float16 key/value cache of the
      rollout);
    - the optimizer becomes ``lsj.LossScaleOptimizer`` around the Optax optimizer the trainer
      holds, with the trainer's ``wrt`` (``nnx.Param``, or ``nnx.LoRAParam`` under LoRA):
      ``lsj.loss_scaling(inner, policy)``, or ``loss_scaling_multi_steps(inner, policy,
      every_k=k)`` where the trainer accumulates ``k`` micro-batches (Tunix's
      ``gradient_accumulation_steps``, or an ``optax.MultiSteps(opt, every_k_schedule=k)``
      given as the optimizer: either ``MultiSteps`` is unwrapped, its window kept, an
      overflowing window skipped whole; both at once, a schedule, ``use_grad_mean=False``
      or ``should_skip_update_fn`` are refused, naming the fix); float16 parameters get
      float32 masters (``lsj.master_weights``); a plain optimizer state Tunix restored from
      a checkpoint carries over;
    - the train step takes the gradients of whatever loss the trainer holds when it is
      traced, scaled (``lsj.value_and_grad``), and skips an overflowing step (the parameters
      and the optimizer's state and ``step`` unchanged, the policy's scale adjusted);
    - the trainer logs, beside its loss: ``grad_norm`` unscaled (inf or nan on a skipped
      step), ``loss_scale/scale_used`` (the scale the step's loss was multiplied by),
      ``loss_scale/loss_scale`` (the scale after the step's adjustment: the next step's),
      ``loss_scale/skipped``, ``loss_scale/skipped_steps``, ``loss_scale/overflow_rate``;
      the first skipped step is also said in a log line of
      ``lossscale_jax.integrations.tunix`` (what was not finite: the loss, or the gradients
      and which leaf; what the policy did with its scale), and so is a run that no loss
      scale can fix (a non-finite loss, or a scale the policy does not lower, on 3 steps in
      a row: stuck); an RL learner's actor also the
      rollout/trainer mismatch on the sampled tokens, before any update
      (``rollout_mismatch``): ``mismatch/kl``,
      ``mismatch/abs_log_ratio``, ``mismatch/max_abs_log_ratio``,
      ``mismatch/clip_fraction`` (the share whose ratio lies outside the learner's clip
      range) and ``mismatch/exact_fraction`` (the share whose log-probs agree bit for bit);
    - checkpoints hold the loss-scaled optimizer's state; a run built again in a fresh
      process and given ``enable`` restores it and continues bit for bit.

    Tunix's own counters (``train_steps``, ``max_steps``, the checkpoint cadence) count
    skipped steps too; the optimizer's ``step`` (and so a schedule) counts applied ones.

    The policies RL stacks ship are in ``lsj.presets``: ``precision_rl()`` (torch's rule,
    growth after 400 good steps: Precision-RL's and verl's FSDP float16 actor),
    ``verl_megatron()``, ``megatron_lm()``, ``torch_amp()``, ``deepspeed_fp16()``.

    Args:
      target: a ``PeftTrainer`` (any subclass that keeps Tunix's step), an ``RLLearner``
        (GRPO, DAPO, Dr. GRPO, PPO: its cluster's actor trainer, and critic trainer if any)
        or an ``RLCluster`` (its trainers; no mismatch metric, which needs the learner). Not
        one trainer of an RL cluster alone: its rollout samples from the same model.
      policy: the actor's (or the trainer's) loss-scale policy. Default:
        ``lsj.DynamicScale()`` for float16 compute, ``lsj.NoScale(skip_on_overflow=True)``
        (no loss scale, a non-finite step still skipped) for bfloat16 and float32, which do
        not need one (given one anyway, it warns). Each trainer keeps a state of its own.
      critic_policy: PPO's critic's policy (its gradients have another range than the
        actor's: a value head's squared error); default: ``policy``.
      compute_dtype: the dtype the models compute in; ``None`` leaves them as built (the
        default policy then follows the dtype they compute in).
      rollout_mismatch: log the rollout/trainer mismatch (one more forward pass per
        micro-batch, no backward). Default: on for a learner, off otherwise.

    Returns:
      ``target``.

    Raises:
      IntegrationError: for a google-tunix release that lacks a name the integration relies
        on (naming it), an object it does not know, one trainer of an RL cluster, a trainer
        already enabled or whose step is overridden, a model without a compute dtype whose
        parameters are not ``compute_dtype``, ``critic_policy`` without a critic, or
        ``rollout_mismatch=True`` without a learner.
    """
    _seams.check()
    trainers, learner, cluster = _targets(target)
    policies = _policies(trainers, policy, critic_policy, compute_dtype)
    if rollout_mismatch and learner is None:
        raise IntegrationError(
            "enable(..., rollout_mismatch=True) needs the RL learner (its rollout and its "
            f"loss), got {type(target).__name__}: pass the learner."
        )
    changes: list[Change] = []
    if compute_dtype is not None:
        changes += [_models.compute_dtype_change(t.model, compute_dtype) for t in trainers]
        if cluster is not None:
            changes.append(_models.rollout_change(cluster, compute_dtype))
    changes += [_trainer_change(t, p) for t, p in zip(trainers, policies, strict=True)]
    if learner is not None and rollout_mismatch is not False:
        changes.append(_mismatch.change(learner))
    # Every check has passed: from here on, the changes.
    if compute_dtype is not None:
        _models.patch_mask_constants(compute_dtype)
    _lora.install()
    _changes.apply(changes)
    return target


def _targets(target: Any) -> tuple[list[Any], Any, Any]:
    """``(trainers, learner, cluster)`` of what ``enable`` was given (``None`` for those it
    was not given)."""
    if isinstance(target, rl_trainer.Trainer):
        critic = _has_critic(_cluster_of(target))
        raise IntegrationError(
            "enable() was given one trainer of an RL cluster (a tunix.rl.trainer.Trainer): "
            "its rollout samples from the same model, and would be left computing in another "
            "dtype. Call "
            + (
                "enable(learner, policy, critic_policy=...) on the RL learner (or "
                "enable(cluster, ...) before the learner exists): each trainer gets a scale "
                "of its own, the critic's from critic_policy."
                if critic
                else "enable(learner, policy) on the RL learner (or enable(cluster, policy) "
                "before the learner exists)."
            )
        )
    if isinstance(target, peft_trainer.PeftTrainer):
        return [target], None, None
    if type(target).__module__.startswith("tunix.experimental"):
        raise IntegrationError(
            f"enable() does not take Tunix's experimental {type(target).__qualname__} "
            f"({type(target).__module__}: separate forward-backward and update steps) yet: "
            "train with tunix.sft.peft_trainer.PeftTrainer (or an RL learner) instead."
        )
    learner = target if isinstance(target, rl_learner.RLLearner) else None
    cluster = learner.rl_cluster if learner is not None else target
    if not isinstance(cluster, rl_cluster_lib.RLCluster):
        raise IntegrationError(
            "enable() takes a Tunix PeftTrainer (or a subclass), an RLLearner or an "
            f"RLCluster, got {type(target).__name__}."
        )
    trainers = [cluster.actor_trainer]
    try:
        trainers.append(cluster.critic_trainer)
    except AttributeError:  # no critic: RLCluster says so by raising
        pass
    return trainers, learner, cluster


def _cluster_of(trainer: Any) -> Any:
    """The ``RLCluster`` that built ``trainer`` (its checkpoint metadata function closes over
    it, in google-tunix 0.1.7), or ``None`` where it cannot be found."""
    fn = getattr(trainer, "custom_checkpoint_metadata_fn", None)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            held = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(held, rl_cluster_lib.RLCluster):
            return held
    return None


def _has_critic(cluster: Any) -> bool:
    """Whether ``cluster`` (``None``: not found) has a critic's trainer."""
    if cluster is None:
        return False
    try:
        return cluster.critic_trainer is not None
    except AttributeError:  # no critic: RLCluster says so by raising
        return False


def _policies(
    trainers: list[Any],
    policy: LossScalePolicy | None,
    critic_policy: LossScalePolicy | None,
    compute_dtype: Any,
) -> list[LossScalePolicy]:
    """Each trainer's policy: the actor's (or the trainer's) ``policy``, the critic's
    ``critic_policy`` (``policy`` when ``None``); the defaults by ``compute_dtype``."""
    if critic_policy is not None and len(trainers) < 2:
        raise IntegrationError(
            "enable(..., critic_policy=...) is for PPO's critic, and this target has no "
            "critic trainer: pass policy alone."
        )
    if compute_dtype is None:  # the models as built: the actor's (or the trainer's) dtype
        compute_dtype = _models.compute_dtype_of(trainers[0].model)
    policy = _changes.default_policy(policy, compute_dtype, stacklevel=4)  # enable's caller
    if critic_policy is not None:
        critic_policy = _changes.default_policy(critic_policy, compute_dtype, "critic_policy", 4)
    else:
        critic_policy = policy
    return [policy, critic_policy][: len(trainers)]


def _trainer_change(trainer: Any, policy: LossScalePolicy) -> Change:
    """The loss-scaled optimizer, step, metrics and checkpoints of ``trainer``, checked and
    built now, installed when the change is made."""
    missing = _seams.instance_missing(trainer)
    if missing:
        raise IntegrationError(
            f"enable(): this {type(trainer).__name__} lacks what the integration relies on: "
            f"{'; '.join(missing)}."
        )
    old = trainer.optimizer
    if isinstance(old, LossScaleOptimizer):
        raise IntegrationError(
            "enable(): this trainer's optimizer is already loss-scaled (enable() was called "
            "on it before); call it once per trainer."
        )
    own_step = _maxtext.own_step(trainer, peft_trainer.PeftTrainer)  # MaxText's, kept
    if own_step is None:
        _check_own_step(trainer)
    if trainer._lora_enabled and _lora.missing():
        raise IntegrationError(
            "enable(): this trainer trains a LoRA, and the qwix installed lacks what the "
            "integration needs to compute it in the model's compute dtype: "
            f"{', '.join(_lora.missing())}. Install the qwix google-tunix "
            f"{TESTED_VERSIONS[-1]} comes with, or pass compute_dtype=None and build the "
            "model in the dtype to train in."
        )
    kind = _seams.kind()
    if kind == "accumulator":
        _check_accumulator_trainer(trainer, own_step is not None)
    tunix_k = trainer.config.gradient_accumulation_steps  # None: unset
    the_plan = _optimizer.plan(old.tx, tunix_k, wrapped=kind == "multisteps")
    new = _optimizer.build(trainer.model, old, the_plan, policy, LossScaleOptimizer)

    def change() -> None:
        trainer.optimizer = new
        trainer.clear_jit_cache()
        if own_step is not None:
            trainer.create_train_step_fn = own_step
        else:
            make = make_train_step if kind == "multisteps" else _accumulating_step.make_train_step
            step = make(trainer)
            trainer.create_train_step_fn = lambda: step
        route_metrics(trainer)
        _checkpoint.install(trainer, v1=kind == "accumulator")
        _checkpoint.restore(trainer, tunix_k or 1)

    return change


def _check_accumulator_trainer(trainer: Any, maxtext: bool) -> None:
    """Refuses, on Tunix's main branch (its own gradient accumulator), what ``enable`` does
    not build there yet, naming it: MaxText's SFT trainer."""
    if maxtext:
        raise IntegrationError(
            "enable(): MaxText's MaxTextPeftTrainer on this Tunix (its main branch, a "
            "gradient accumulator of its own) is not supported yet: train it with "
            f"google-tunix {TESTED_VERSIONS[-1]}."
        )


def _check_own_step(trainer: Any) -> None:
    """Refuses a trainer whose class overrides Tunix's step: ``enable`` would replace it
    silently (with whatever that class adds to it)."""
    base = peft_trainer.PeftTrainer
    for name in ("create_train_step_fn", "_train_step"):
        own = getattr(type(trainer), name)
        if own is not getattr(base, name):
            raise IntegrationError(
                f"enable(): {type(trainer).__qualname__} overrides PeftTrainer.{name} "
                f"(defined in {own.__module__}); enable() replaces Tunix's step with the "
                "loss-scaled one and would drop what that override adds. Train it with "
                "PeftTrainer's own step, or without enable()."
            )
