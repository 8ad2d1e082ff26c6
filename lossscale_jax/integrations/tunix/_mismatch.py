# pyright: reportMissingImports=false
# (Tunix is an optional dependency: the type check runs without it installed.)
"""The rollout/trainer mismatch of an RL learner, logged each step.

The rollout samples each token from its own log-probs; the training step recomputes them
with its own kernels (a full forward pass instead of a key/value-cache decode). Their gap is
the mismatch that float16 with a loss scale shrinks against bfloat16 (Qi et al. 2025), and
Tunix 0.1.7's GRPO never shows it: with ``num_iterations=1`` its old log-probs are the
trainer's own, and the rollout's are dropped. :func:`change` keeps them:

- the rollout is asked for its log-probs (``RolloutConfig.return_logprobs``, set per call);
  the learner sees them only where its own rollout config asked for them (a learner that
  reads them, as Tunix's next GRPO does, would otherwise change its ratio);
- the learner's ``TrainExample`` carries them (a subclass with one more field, as PPO's adds
  its own); positions the rollout gave no log-prob for (padding, the end token) are left out;
- the trainer's loss also recomputes the sampled tokens' log-probs (no gradient) at the
  rollout's temperature, before the update, and puts in its aux, over the sampled tokens
  (:func:`mismatch`): ``mismatch/kl`` = mean(exp(d) - 1 - d), ``d = logp_trainer -
  logp_rollout`` (the k3 estimate of KL(rollout || trainer)), ``mismatch/abs_log_ratio`` =
  mean |d|, ``mismatch/max_abs_log_ratio``, and the two shares RL practitioners read first:
  ``mismatch/clip_fraction``, the tokens whose ratio ``exp(d)`` already lies outside the
  learner's clip range (its own epsilons) before any update ("phantom clipping": the
  clipped surrogate drops their gradient for a difference of kernels, not of policies), and
  ``mismatch/exact_fraction``, the tokens whose two float32 log-probs are equal bit for bit
  (bitwise on-policy); the trainer logs them with its own metrics.

The cost: one more forward pass of the micro-batch (no backward) inside the train step.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from tunix.rl import common as rl_common
from tunix.rl import rl_cluster as rl_cluster_lib

from lossscale_jax.errors import IntegrationError
from lossscale_jax.integrations._host._mismatch import METRICS, mismatch

FIELD = "rollout_per_token_logps"


@functools.cache
def _carrying(example_type: type) -> type:
    """``example_type`` with one more field, the rollout's per-token log-probs."""
    namespace = {"__annotations__": {FIELD: Any}, FIELD: None, "__module__": __name__}
    subclass = type(f"{example_type.__name__}WithRolloutLogps", (example_type,), namespace)
    return struct.dataclass(frozen=True)(subclass)


def _attach(example: Any, logprobs: list[Any] | None) -> Any:
    """``example`` carrying ``logprobs`` (one list per sample) as ``[B, T]`` float32, nan
    where the rollout gave none."""
    rows, width = example.completion_ids.shape
    table = np.full((rows, width), np.nan, np.float32)
    for i, row in enumerate(logprobs or []):
        n = min(len(row), width)
        table[i, :n] = np.asarray(row[:n], np.float32)
    fields = {f.name: getattr(example, f.name) for f in dataclasses.fields(example)}
    return _carrying(type(example))(**fields, **{FIELD: jnp.asarray(table)})


def clip_range(learner: Any) -> tuple[float, float]:
    """``(low, high)``: the learner's clip range of the ratio, ``[1 - low, 1 + high]``, as its
    loss reads it (PPO's ``epsilon_low``/``epsilon_high``; GRPO's and DAPO's ``epsilon`` and,
    where set, ``epsilon_high``)."""
    config = learner.algo_config
    epsilon = config.epsilon
    low = getattr(config, "epsilon_low", None) or epsilon
    high = getattr(config, "epsilon_high", None) or epsilon
    return float(low), float(high)


def change(learner: Any) -> Callable[[], None]:
    """What logs the mismatch of ``learner``'s actor each step (see the module's docstring),
    read from the learner now (its clip range, the rollout's temperature and tokens) and
    installed when called."""
    cluster = learner.rl_cluster
    loss_fn = cluster.actor_trainer.loss_fn
    if "train_example" not in inspect.signature(loss_fn).parameters:
        raise IntegrationError(
            f"enable(): the loss {type(learner).__name__} set on the actor's trainer "
            f"({getattr(loss_fn, '__qualname__', loss_fn)!r}) takes no `train_example`, "
            "which the rollout mismatch reads; pass rollout_mismatch=False."
        )
    config = getattr(learner, "algo_config", None)
    if not isinstance(getattr(config, "epsilon", None), float | int):
        raise IntegrationError(
            f"enable(): {type(learner).__name__} has no algo_config.epsilon (its clip "
            "range), which mismatch/clip_fraction reads; pass rollout_mismatch=False."
        )
    clip = clip_range(learner)
    temperature = cluster.get_rollout_config(mode=rl_cluster_lib.Mode.TRAIN).temperature
    pad_id, eos_id = cluster.rollout.pad_id(), cluster.rollout.eos_id()
    return functools.partial(_install, learner, clip, temperature, pad_id, eos_id)


def _install(
    learner: Any, clip: tuple[float, float], temperature: float, pad_id: int, eos_id: int
) -> None:
    cluster = learner.rl_cluster
    trainer = cluster.actor_trainer
    seen = threading.local()  # the learner prepares data in a thread of its own

    rollout_generate = cluster.rollout.generate

    def rollout_with_logprobs(prompts: Any, rollout_config: Any, **kwargs: Any) -> Any:
        seen.asked = rollout_config.return_logprobs
        config = dataclasses.replace(rollout_config, return_logprobs=True)
        return rollout_generate(prompts, config, **kwargs)

    cluster_generate = cluster.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        out = cluster_generate(*args, **kwargs)
        seen.logprobs = out.logprobs
        if not getattr(seen, "asked", True):  # the learner sees what its config asked for
            out = dataclasses.replace(out, logprobs=None)
        return out

    prepare = learner._generate_and_compute_advantage

    def prepare_with_logprobs(*args: Any, **kwargs: Any) -> Any:
        seen.logprobs = None
        example = prepare(*args, **kwargs)
        return _attach(example, seen.logprobs)

    cluster.rollout.generate = rollout_with_logprobs
    cluster.generate = generate
    learner._generate_and_compute_advantage = prepare_with_logprobs

    loss_fn, has_aux = trainer.loss_fn, trainer._has_aux
    signature = inspect.signature(loss_fn)

    @functools.wraps(loss_fn)
    def with_mismatch(*args: Any, **kwargs: Any) -> Any:
        out = loss_fn(*args, **kwargs)
        loss_output = hasattr(out, "aux_metrics")  # Tunix's main branch: a LossOutput
        loss, aux = (out, {}) if loss_output or not has_aux else out
        bound = signature.bind(*args, **kwargs).arguments
        example = bound["train_example"]
        graphdef, state = nnx.split(args[0] if args else bound["model"])
        logp = rl_common.compute_per_token_logps(
            graphdef,
            state,
            prompt_tokens=example.prompt_ids,
            completion_tokens=example.completion_ids,
            pad_id=pad_id,
            eos_id=eos_id,
            stop_gradient=True,
            temperature=temperature,
        )
        extra = mismatch(logp, getattr(example, FIELD), example.completion_mask, clip)
        if loss_output:  # its metrics travel in it, as Tunix's own do
            return out.replace(aux_metrics={**out.aux_metrics, **extra})
        return loss, {**dict(aux), **extra}

    trainer.with_loss_fn(with_mismatch, has_aux=True)
    trainer.with_rl_metrics_to_log({**trainer.rl_metrics_to_log, **METRICS})
