# pyright: reportMissingImports=false
# (Tunix is an optional dependency: the type check runs without it installed.)
"""Tunix (``google-tunix``): its SFT and RL trainers in float16 with loss scaling, one call.

``pip install "lossscale_jax[tunix]"``; Tunix loads only when this module is imported.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lossscale_jax.accumulation import loss_scaling_multi_steps
from lossscale_jax.engine._landing import float16_leaves
from lossscale_jax.errors import IntegrationError
from lossscale_jax.master import master_weights
from lossscale_jax.policies import DynamicScale, LossScalePolicy
from lossscale_jax.transform import loss_scaling

try:
    from flax import nnx
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl import rl_learner
    from tunix.sft import peft_trainer
except ImportError as _missing:  # the floor CI leg checks the message
    raise IntegrationError(
        "lossscale_jax.integrations.tunix needs Tunix: pip install 'lossscale_jax[tunix]' "
        f"(google-tunix 0.1.7). ({_missing})"
    ) from _missing

from lossscale_jax.flax_utils import LossScaleOptimizer
from lossscale_jax.integrations import _tunix_checkpoint, _tunix_mismatch, _tunix_models
from lossscale_jax.integrations._tunix_step import make_train_step, route_metrics

__all__ = ["SUPPORTED_VERSIONS", "enable"]

#: The google-tunix releases this integration was tested with (its trainer's private step,
#: whose signature changes between releases, is what ``enable`` replaces).
SUPPORTED_VERSIONS: tuple[str, ...] = ("0.1.7",)


def check_version(version: str | None = None) -> str:
    """The installed google-tunix version, if this integration was tested with it; else
    ``IntegrationError`` naming both."""
    found = version if version is not None else importlib.metadata.version("google-tunix")
    if found not in SUPPORTED_VERSIONS:
        raise IntegrationError(
            f"lossscale_jax.integrations.tunix was tested with google-tunix "
            f"{', '.join(SUPPORTED_VERSIONS)}; this environment has {found}. Its trainer's "
            "step (which enable() replaces) differs between releases: install a tested one, "
            f"pip install 'google-tunix=={SUPPORTED_VERSIONS[-1]}'."
        )
    return found


def enable(
    target: Any,
    policy: LossScalePolicy | None = None,
    *,
    compute_dtype: Any = jnp.float16,
    rollout_mismatch: bool | None = None,
) -> Any:
    """Makes a Tunix trainer (or an RL learner's trainers) train in float16 with loss scaling.

    Call it once, after the trainer is built with a plain Optax optimizer (as Tunix's docs
    build it), or after the RL learner is built (it sets its own loss on the actor's trainer),
    and before ``train``. For each trainer (the actor's, and the critic's under PPO):

    - ``compute_dtype`` (float16 by default): the model computes in it (its ``config.dtype``
      and every submodule's; a model without one must hold parameters of that dtype), and
      every Tunix model's attention mask constant is made finite in it (``-2.38e38`` is
      ``-inf`` in float16: a fully padded row would be nan);
    - the optimizer becomes ``lsj.LossScaleOptimizer`` around the Optax optimizer the trainer
      holds, with the trainer's ``wrt`` (``nnx.Param``, or ``nnx.LoRAParam`` under LoRA):
      ``lsj.loss_scaling(inner, policy)``, or ``loss_scaling_multi_steps(inner, policy,
      every_k=k)`` where Tunix accumulates ``k`` micro-batches (its ``optax.MultiSteps`` is
      unwrapped); float16 parameters get float32 masters (``lsj.master_weights``); a plain
      optimizer state Tunix restored from a checkpoint carries over;
    - the train step takes the gradients of whatever loss the trainer holds when it is
      traced, scaled (``lsj.value_and_grad``), and skips an overflowing step (the parameters
      and the optimizer's state and ``step`` unchanged, the scale backed off);
    - the trainer logs, beside its loss: ``grad_norm`` unscaled (inf or nan on a skipped
      step), ``loss_scale/loss_scale``, ``loss_scale/skipped``, ``loss_scale/skipped_steps``,
      ``loss_scale/overflow_rate``; an RL learner's actor also ``mismatch/kl``,
      ``mismatch/abs_log_ratio``, ``mismatch/max_abs_log_ratio`` (the rollout's log-probs
      against the trainer's, on the sampled tokens; ``rollout_mismatch``);
    - checkpoints hold the loss-scaled optimizer's state; a run built again in a fresh
      process and given ``enable`` restores it and continues bit for bit.

    Tunix's own counters (``train_steps``, ``max_steps``, the checkpoint cadence) count
    skipped steps too; the optimizer's ``step`` (and so a schedule) counts applied ones.

    Args:
      target: a ``PeftTrainer`` (any subclass), an ``RLLearner`` (GRPO, DAPO, Dr. GRPO, PPO:
        its cluster's actor trainer, and critic trainer if any) or an ``RLCluster`` (its
        trainers; no mismatch metric, which needs the learner).
      policy: the loss-scale policy (``lsj.DynamicScale()`` by default; RL stacks' settings:
        ``lsj.presets``). Each trainer keeps a state of its own.
      compute_dtype: the dtype the models compute in; ``None`` leaves them as built.
      rollout_mismatch: log the rollout/trainer mismatch (one more forward pass per
        micro-batch, no backward). Default: on for a learner, off otherwise.

    Returns:
      ``target``.

    Raises:
      IntegrationError: for a google-tunix release this was not tested with (naming both),
        an object it does not know, a trainer already enabled, a model without a compute
        dtype whose parameters are not ``compute_dtype``, or ``rollout_mismatch=True``
        without a learner.
    """
    check_version()
    policy = DynamicScale() if policy is None else policy
    trainers, learner, cluster = _targets(target)
    if rollout_mismatch and learner is None:
        raise IntegrationError(
            "enable(..., rollout_mismatch=True) needs the RL learner (its rollout and its "
            f"loss), got {type(target).__name__}: pass the learner."
        )
    if compute_dtype is not None:
        _tunix_models.patch_mask_constants(compute_dtype)
        for trainer in trainers:
            _tunix_models.set_compute_dtype(trainer.model, compute_dtype)
        if cluster is not None:
            _tunix_models.refresh_rollout(cluster, compute_dtype)
    for trainer in trainers:
        _enable_trainer(trainer, policy)
    if learner is not None and rollout_mismatch is not False:
        _tunix_mismatch.install(learner)
    return target


def _targets(target: Any) -> tuple[list[Any], Any, Any]:
    """``(trainers, learner, cluster)`` of what ``enable`` was given (``None`` for those it
    was not given)."""
    if isinstance(target, peft_trainer.PeftTrainer):
        return [target], None, None
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


def _enable_trainer(trainer: Any, policy: LossScalePolicy) -> None:
    old = trainer.optimizer
    if isinstance(old, LossScaleOptimizer):
        raise IntegrationError(
            "enable(): this trainer's optimizer is already loss-scaled (enable() was called "
            "on it before); call it once per trainer."
        )
    inner, every_k = old.tx, trainer.config.get_with_default("gradient_accumulation_steps", 1)
    every_k = every_k or 1
    multi_steps = isinstance(inner, optax.MultiSteps)  # Tunix's accumulation
    if multi_steps:
        inner = inner.inner_opt
    master = bool(float16_leaves(nnx.as_pure(nnx.state(trainer.model, old.wrt))))
    if master:
        inner = master_weights(inner)
    if every_k > 1:
        tx = loss_scaling_multi_steps(inner, policy, every_k=every_k)
    else:
        tx = loss_scaling(inner, policy)
    new = LossScaleOptimizer(trainer.model, tx, wrt=old.wrt)
    if not master:
        _carry_over(old, new, multi_steps)
    trainer.optimizer = new
    trainer.clear_jit_cache()
    step = make_train_step(trainer)
    trainer.create_train_step_fn = lambda: step
    route_metrics(trainer)
    _tunix_checkpoint.install(trainer)
    _tunix_checkpoint.restore(trainer, every_k)


def _carry_over(old: Any, new: Any, multi_steps: bool) -> None:
    """The plain optimizer's state (Tunix may have restored it from a checkpoint) into the
    loss-scaled one's inner state, and its step, where they have the same structure."""
    if not int(np.asarray(old.step[...])):
        return  # a fresh optimizer: nothing to carry
    plain = nnx.as_pure(old.opt_state)
    plain = plain.inner_opt_state if multi_steps else plain
    state = nnx.as_pure(new.opt_state)
    if jax.tree_util.tree_structure(plain) != jax.tree_util.tree_structure(state.inner_state):
        return
    nnx.update(new.opt_state, nnx.state(state._replace(inner_state=plain)))
    new.step[...] = old.step[...]
