"""The names of Tunix the integration relies on (its seams), checked before ``enable`` acts.

A Tunix release is admitted by what it has, not by its version string: every module,
class, method, signature and field below must be there as the integration uses it. A release
that lacks one is refused, naming each that is missing or changed and what the integration
does with it; a release whose seams are all there works, with an ``IntegrationWarning``
where it is not a release the integration was tested with (:data:`TESTED`).

What a trainer instance must hold (attributes its constructor sets) is checked on the
instance: :func:`instance_missing`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import warnings
from typing import Any

from lossscale_jax.errors import IntegrationError, IntegrationWarning

#: The google-tunix releases the integration was tested with.
TESTED: tuple[str, ...] = ("0.1.7",)


@dataclasses.dataclass(frozen=True)
class Seam:
    """One name the integration relies on: ``module``'s ``name`` (dotted within it).

    ``params``: the parameters a callable must take, in this order and no others (the
    integration replaces it, or is called as it); ``takes``: parameters it must accept among
    others (the integration passes them by name); ``fields``: fields a dataclass must have.
    """

    module: str
    name: str
    use: str
    params: tuple[str, ...] | None = None
    takes: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()

    @property
    def path(self) -> str:
        return f"{self.module}.{self.name}"

    def problem(self) -> str | None:
        """What is missing or changed (``None``: the seam is there as used)."""
        try:
            found: Any = importlib.import_module(self.module)
        except ImportError as e:
            return f"{self.module}: the module is missing ({e})"
        for part in self.name.split("."):
            if not hasattr(found, part):
                return f"{self.path}: missing"
            found = getattr(found, part)
        if self.params is not None or self.takes:
            have = tuple(inspect.signature(found).parameters)
            if self.params is not None and have != self.params:
                return (
                    f"{self.path}{_signature(have)}: the integration needs "
                    f"{self.path}{_signature(self.params)}"
                )
            lacking = [p for p in self.takes if p not in have]
            if lacking:
                return f"{self.path}{_signature(have)}: takes no {', '.join(lacking)}"
        if self.fields:
            names = {f.name for f in dataclasses.fields(found)}
            lacking = [f for f in self.fields if f not in names]
            if lacking:
                return f"{self.path}: has no field {', '.join(lacking)}"
        return None


def _signature(params: tuple[str, ...]) -> str:
    return f"({', '.join(params)})"


_PEFT = "tunix.sft.peft_trainer"
_CLUSTER = "tunix.rl.rl_cluster"
#: The seams every release the integration takes has.
COMMON: tuple[Seam, ...] = (
    Seam(_PEFT, "PeftTrainer", "the trainers enable() takes (SFT, and the RL trainers)"),
    Seam(_PEFT, "PeftTrainer.create_train_step_fn", "where the trainer takes its step"),
    Seam(_PEFT, "PeftTrainer.clear_jit_cache", "the step compiled again after the swap"),
    Seam(
        _PEFT,
        "PeftTrainer._post_process_train_step",
        "the hook through which the loss scale's metrics reach the trainer's logger",
    ),
    Seam(
        _PEFT,
        "TrainingConfig",
        "the accumulation enable() turns into one decision per window, and the checkpoints",
        fields=(
            "gradient_accumulation_steps",
            "checkpoint_root_directory",
            "checkpointing_options",
        ),
    ),
    Seam(
        "tunix.sft.checkpoint_manager",
        "CheckpointManager.maybe_restore",
        "the loss-scaled optimizer restored from the trainer's checkpoints",
        takes=("model", "optimizer", "restore_only_lora_params"),
    ),
    Seam("tunix.rl.rl_learner", "RLLearner", "the RL learners enable() takes"),
    Seam(
        "tunix.rl.rl_learner",
        "RLLearner._generate_and_compute_advantage",
        "the rollout's log-probs carried to the training step (the mismatch metrics)",
    ),
    Seam(_CLUSTER, "RLCluster", "an RL learner's trainers and rollout"),
    Seam(_CLUSTER, "RLCluster.actor_trainer", "the actor's trainer"),
    Seam(_CLUSTER, "RLCluster.critic_trainer", "PPO's critic's trainer"),
    Seam(_CLUSTER, "RLCluster.rollout", "the rollout switched to the compute dtype"),
    Seam(_CLUSTER, "RLCluster.generate", "the rollout's log-probs (the mismatch metrics)"),
    Seam(_CLUSTER, "RLCluster.get_rollout_config", "the rollout's temperature"),
    Seam(
        "tunix.rl.trainer",
        "Trainer.with_rl_metrics_to_log",
        "the mismatch metrics logged beside the learner's own",
    ),
    Seam(
        "tunix.rl.rollout.base_rollout",
        "RolloutConfig",
        "the rollout asked for its log-probs",
        fields=("return_logprobs", "temperature"),
    ),
    Seam(
        "tunix.rl.common",
        "compute_per_token_logps",
        "the trainer's log-probs of the sampled tokens (the mismatch metrics)",
        takes=(
            "graphdef",
            "state",
            "prompt_tokens",
            "completion_tokens",
            "pad_id",
            "eos_id",
            "stop_gradient",
            "temperature",
        ),
    ),
)

#: google-tunix 0.1.7's step: ``_train_step(model, optimizer, inputs)``, its accumulation an
#: ``optax.MultiSteps`` around the optimizer.
MULTISTEPS: tuple[Seam, ...] = (
    Seam(
        _PEFT,
        "PeftTrainer._train_step",
        "the step enable() replaces, called with the model, the optimizer and the inputs",
        params=("self", "model", "optimizer", "inputs"),
    ),
    Seam(
        "tunix.sft.checkpoint_manager",
        "_DEFAULT_CHECKPOINTING_OPTIONS",
        "the checkpoint manager enable() gives the trainer, with Tunix's own options",
    ),
)
#: Tunix's main branch (tested at commit :data:`MAIN_COMMIT`, its pyproject at 0.1.8): the step
#: takes a gradient accumulator of Tunix's and whether the step updates (under ``nnx.cond``);
#: a loss may return a ``LossOutput`` whose loss is a sum over tokens and its denominator.
ACCUMULATOR: tuple[Seam, ...] = (
    Seam(
        _PEFT,
        "PeftTrainer._train_step",
        "the step enable() replaces, called with the model, the optimizer, Tunix's gradient "
        "accumulator, the inputs and whether the step updates",
        params=("self", "model", "optimizer", "grad_accumulator", "inputs", "is_update_step"),
    ),
    Seam(_PEFT, "GradientAccumulator.add", "a micro-batch's gradients added to the window"),
    Seam(_PEFT, "GradientAccumulator.reset", "the window emptied after its update"),
    Seam(_PEFT, "_metric_reducer", "a LossOutput's metrics buffered as Tunix buffers them"),
    Seam(
        _PEFT,
        "MetricsBuffer",
        "a LossOutput's loss buffered as Tunix buffers it (weighted)",
        fields=("losses", "additional_metrics"),
    ),
    Seam(
        "tunix.sft.utils",
        "LossOutput",
        "a loss returned as a sum over tokens and its count",
        fields=("primary_loss", "aux_metrics"),
    ),
    Seam(
        "tunix.sft.checkpoint_manager",
        "CheckpointManager",
        "the checkpoint manager enable() gives the trainer (its Orbax v1 checkpointer "
        "wrapped: the loss-scaled optimizer saved under a name of its own)",
        takes=("root_directory", "options"),
    ),
    Seam(
        "tunix.sft.utils",
        "WeightedMetric",
        "the loss normalised before the backward pass",
        fields=("unreduced_sum", "denominator"),
    ),
)
#: The commit of Tunix's main branch the ``ACCUMULATOR`` seams were tested at.
MAIN_COMMIT = "c7d8950"
SEAMS: tuple[Seam, ...] = COMMON + MULTISTEPS


def kind() -> str:
    """Which step the installed Tunix has: ``"multisteps"`` (google-tunix 0.1.7's) or
    ``"accumulator"`` (Tunix's main branch: a gradient accumulator of its own)."""
    step = ACCUMULATOR[0]
    return "accumulator" if step.problem() is None else "multisteps"


#: What a trainer instance must hold, set by its constructor: name -> what it is for.
TRAINER_ATTRIBUTES: dict[str, str] = {
    "model": "the model trained",
    "optimizer": "the nnx.Optimizer enable() replaces",
    "config": "the trainer's TrainingConfig",
    "loss_fn": "the loss the step differentiates",
    "gen_model_input_fn": "the step's inputs",
    "_has_aux": "whether the loss returns aux",
    "_lora_enabled": "whether the step differentiates the LoRA parameters alone",
    "_buffered_train_metrics": "the buffer the trainer logs from",
    "checkpoint_manager": "the trainer's checkpoints",
    "checkpoint_manager._checkpoint_manager": (
        "the Orbax manager Tunix's checkpoint manager saves and restores through"
    ),
    "_train_steps": "the step counter restored with a checkpoint",
    "_iter_steps": "the micro-step counter restored with a checkpoint",
    "metrics_logger": "the trainer's metrics logger",
}


def version() -> str:
    """The installed google-tunix release."""
    return importlib.metadata.version("google-tunix")


def check(found: str | None = None) -> str:
    """The installed release, if every seam is there (``IntegrationWarning`` where it was not
    tested); else ``IntegrationError`` naming each seam missing or changed."""
    found = version() if found is None else found
    seams = COMMON + (ACCUMULATOR if kind() == "accumulator" else MULTISTEPS)
    problems = [(seam, seam.problem()) for seam in seams]
    problems = [(seam, p) for seam, p in problems if p is not None]
    if problems:
        lines = "\n".join(f"- {p} (used for {seam.use})" for seam, p in problems)
        raise IntegrationError(
            f"lossscale_jax.integrations.tunix: google-tunix {found} lacks what the "
            f"integration relies on:\n{lines}\nIt was tested with google-tunix "
            f"{', '.join(TESTED)} and Tunix's main branch at {MAIN_COMMIT}: pip install "
            f"'google-tunix=={TESTED[-1]}'."
        )
    if found not in TESTED:
        warnings.warn(
            f"lossscale_jax.integrations.tunix was tested with google-tunix "
            f"{', '.join(TESTED)} and Tunix's main branch at {MAIN_COMMIT} (0.1.8); this "
            f"environment has {found}, which has every name the "
            "integration relies on. Compare a short run with the float32 one.",
            IntegrationWarning,
            stacklevel=3,
        )
    return found


def instance_missing(trainer: Any) -> list[str]:
    """The attributes of :data:`TRAINER_ATTRIBUTES` that ``trainer`` lacks, with their use
    (on Tunix's main branch, with its accumulator and without 0.1.7's Orbax manager)."""
    wanted = dict(TRAINER_ATTRIBUTES)
    if kind() == "accumulator":
        del wanted["checkpoint_manager._checkpoint_manager"]
        wanted["grad_accumulator"] = "Tunix's gradient accumulator, which the step fills"
    return [f"{name} ({use})" for name, use in wanted.items() if not _has(trainer, name)]


def _has(owner: Any, dotted: str) -> bool:
    """Whether ``owner`` has the attribute path ``dotted`` (``a.b``: ``owner.a.b``)."""
    for part in dotted.split("."):
        if not hasattr(owner, part):
            return False
        owner = getattr(owner, part)
    return True
