"""GRPO in Tunix in float32, bfloat16 and float16: the rollout/trainer mismatch.

Tunix (``google-tunix``) fine-tunes its own models with RL: an ``RLCluster`` samples
with its rollout (here the "vanilla" one: key/value-cache decoding of the actor's own
weights) and a ``GRPOLearner`` trains the actor on the sampled completions. The rollout
and the training step compute the sampled tokens' log-probs with different kernels; in
a low-precision compute dtype they disagree by rounding, and that mismatch is what
float16 with a loss scale shrinks against bfloat16 (Qi et al. 2025). This job measures
it where it arises, with one line added to a Tunix GRPO program::

    lsj_tunix.enable(learner, policy, compute_dtype=dtype)

which makes the actor compute in ``dtype``, trains it with loss scaling, logs the
loss scale and skipped steps, and logs the rollout/trainer mismatch on the sampled
tokens each step (``lossscale_jax.integrations.tunix``): ``mismatch/kl``
(KL(rollout || trainer), the k3 estimate), the share of tokens whose ratio is already
outside GRPO's clip range before the update (``mismatch/clip_fraction``) and the share
whose log-probs agree bit for bit (``mismatch/exact_fraction``).

The model is Tunix's Qwen3 at a small configuration, with no tokenizer to download:
token ``i`` is the word ``t{i}``. It is pretrained briefly in float32 with Tunix's own
SFT trainer on a counting language (each token the previous plus 1 or 2, at random,
from a random start), then fine-tuned with GRPO from the same pretrained weights, per
compute dtype and seed:

- ``float32`` and ``bfloat16``: ``NoScale()`` (no loss scale);
- ``float16``: ``lsj.presets.precision_rl()`` (torch's rule, growth after 400 good
  steps: Precision-RL's setting).

The reward of a completion is the share of its tokens equal to ``t{TARGET}``. Prompts
are left-padded (as Tunix pads them): a float16 run without ``enable`` is nan from its
first step (Tunix's attention mask constant, ``-2.38e38``, is ``-inf`` in float16).

Run: ``python examples/train_tunix_grpo.py`` (a few minutes on 2 CPU cores; ``--size
gpu`` for a GPU; ``--quick`` for the test suite). Needs ``pip install
"lossscale_jax[tunix]"``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import pathlib
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.models.qwen3 import model as qwen3_lib
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout
from tunix.sft import peft_trainer
from tunix.sft import utils as sft_utils

import lossscale_jax as lsj
from lossscale_jax.integrations import tunix as lsj_tunix

PAD, BOS, EOS = 0, 1, 2
FIRST = 3  # the first word token
TARGET = 7  # the reward: the share of completion tokens equal to t7


@dataclasses.dataclass(frozen=True)
class Size:
    """The model, the pretraining and the GRPO run."""

    layers: int
    embed: int
    heads: int
    head_dim: int
    vocab: int
    pretrain_steps: int
    pretrain_batch: int
    seq: int
    steps: int
    prompts: int
    group: int
    gen: int


SIZES = {
    "quick": Size(2, 32, 4, 8, 32, 20, 8, 16, 3, 2, 4, 8),
    "cpu": Size(2, 64, 4, 16, 64, 150, 16, 24, 20, 4, 4, 12),
    "gpu": Size(8, 512, 8, 64, 512, 600, 64, 128, 60, 16, 8, 64),
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class WordTokenizer:
    """Token ``i`` is the word ``t{i}`` (what Tunix's tokenizer adapter calls)."""

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return [int(word[1:]) for word in text.split()]

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str:
        return " ".join(f"t{int(i)}" for i in ids)

    def bos_id(self) -> int:
        return BOS

    def eos_id(self) -> int:
        return EOS

    def pad_id(self) -> int:
        return PAD


def mesh() -> jax.sharding.Mesh:
    """One device; the axis names Qwen3's sharding rules use (Auto axes: Tunix's trainer
    constrains the optimizer's sharding)."""
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=auto)


@contextlib.contextmanager
def entered(grid: jax.sharding.Mesh) -> Iterator[None]:
    """``with grid:``, where Tunix 0.1.7's trainers read their mesh from (JAX deprecated
    it for ``jax.set_mesh``, which they do not read): its warning is silenced here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`with mesh:`", DeprecationWarning)
        grid.__enter__()
    try:
        yield
    finally:
        grid.__exit__(None, None, None)


def qwen3(size: Size, dtype: Any = jnp.float32, seed: int = 0) -> nnx.Module:
    """Tunix's Qwen3 at ``size``, float32 parameters computing in ``dtype``."""
    config = qwen3_lib.ModelConfig(
        num_layers=size.layers,
        vocab_size=size.vocab,
        embed_dim=size.embed,
        hidden_dim=2 * size.embed,
        num_heads=size.heads,
        head_dim=size.head_dim,
        num_kv_heads=size.heads // 2,
        rope_theta=10_000,
        norm_eps=1e-6,
        use_tied_embedding=False,
        dtype=dtype,
        param_dtype=jnp.float32,
    )
    model = qwen3_lib.Qwen3(config, rngs=nnx.Rngs(seed))
    # Qwen3 initialises its MLP's kernels to zero: draw them, so the MLP has gradients.
    key = jax.random.key(seed + 1)
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and "mlp" in [str(p) for p in path]:
            key, sub = jax.random.split(key)
            var[...] = 0.2 * jax.random.normal(sub, var.shape, var.dtype)
    return model


def counting(size: Size, rng: np.random.Generator, length: int) -> np.ndarray:
    """A sequence of the counting language: each word the previous plus 1 or 2, at
    random (wrapping): a language a small model learns quickly, with a log(2) of entropy
    per word left, so that its sampled words are not certain (their log-probs not 0)."""
    words = size.vocab - FIRST
    start = int(rng.integers(0, words))
    steps = np.concatenate([[start], rng.integers(1, 3, length - 1)])
    return FIRST + np.cumsum(steps) % words


def sft_batches(size: Size, n: int, seed: int = 0) -> list[peft_trainer.TrainingInput]:
    """``n`` left-padded batches of counting sequences of random lengths."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(n):
        tokens = np.full((size.pretrain_batch, size.seq), PAD, np.int32)
        for row in tokens:
            length = int(rng.integers(size.seq // 2, size.seq + 1))
            row[size.seq - length :] = np.concatenate(
                [[BOS], counting(size, rng, length - 1)]
            )
        batches.append(
            peft_trainer.TrainingInput(input_tokens=tokens, input_mask=tokens != PAD)
        )
    return batches


def model_inputs(x: peft_trainer.TrainingInput) -> dict[str, Any]:
    """What Tunix's default SFT loss takes: positions and the causal mask."""
    real = x.input_tokens != PAD
    return {
        "input_tokens": x.input_tokens,
        "input_mask": x.input_mask,
        "positions": sft_utils.build_positions_from_mask(real),
        "attention_mask": sft_utils.make_causal_attn_mask(real),
    }


def pretrain(size: Size, seed: int = 0) -> tuple[Any, list[float]]:
    """Tunix's SFT trainer in float32 on the counting language: the weights every
    GRPO run starts from, and the losses."""
    model = qwen3(size, jnp.float32, seed)
    config = peft_trainer.TrainingConfig(
        eval_every_n_steps=10**9, max_steps=size.pretrain_steps
    )
    with entered(mesh()):
        trainer = peft_trainer.PeftTrainer(model, optax.adamw(3e-3), config)
        trainer.with_gen_model_input_fn(model_inputs)
        trainer.train(sft_batches(size, size.pretrain_steps, seed))
    losses = [
        float(v) for v in trainer.metrics_logger.get_metric_history("", "loss", "train")
    ]
    return nnx.state(model, nnx.Param), losses


def reward(prompts: Any, completions: list[str], **kwargs: Any) -> list[float]:
    """The share of each completion's words that are ``t{TARGET}``."""
    return [c.split().count(f"t{TARGET}") / max(len(c.split()), 1) for c in completions]


def prompts_of(size: Size, seed: int) -> list[dict[str, np.ndarray]]:
    """``size.prompts`` prompts per step: counting sequences of 2-5 words."""
    rng = np.random.default_rng(1000 + seed)
    batches = []
    for _ in range(size.steps):
        texts = [
            " ".join(f"t{i}" for i in counting(size, rng, int(rng.integers(2, 6))))
            for _ in range(size.prompts)
        ]
        batches.append({"prompts": np.array(texts)})
    return batches


def policy_of(dtype: str) -> lsj.LossScalePolicy:
    return lsj.presets.precision_rl() if dtype == "float16" else lsj.NoScale()


def grpo(size: Size, weights: Any, dtype: str, seed: int) -> dict[str, Any]:
    """One GRPO run from ``weights`` in ``dtype``: per step, the mismatch, the reward,
    the loss scale and whether the step was skipped."""
    actor = qwen3(size, jnp.float32, seed=0)
    nnx.update(actor, weights)
    grid = mesh()
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=size.gen,
        max_prompt_length=8,
        kv_cache_size=8 + size.gen + 8,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        # A sampled pad ends a completion (Tunix masks pads out of the training step).
        eos_tokens=[EOS, PAD],
        seed=seed,
    )
    training = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.adamw(1e-3),
        eval_every_n_steps=10**9,
        max_steps=size.steps,
    )
    roles = (
        rl_cluster_lib.Role.ACTOR,
        rl_cluster_lib.Role.REFERENCE,
        rl_cluster_lib.Role.ROLLOUT,
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=actor,
        reference=None,
        tokenizer=WordTokenizer(),
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={role: grid for role in roles},
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=training,
            rollout_config=rollout,
        ),
    )
    algo = grpo_learner.GRPOConfig(
        num_generations=size.group, num_iterations=1, beta=0.0
    )
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, algo_config=algo, reward_fns=reward
    )
    lsj_tunix.enable(
        learner, policy_of(dtype), compute_dtype=DTYPES[dtype]
    )  # the one line
    start = time.perf_counter()
    with entered(grid):
        learner.train(prompts_of(size, seed))
    seconds = time.perf_counter() - start
    log = cluster.actor_trainer.metrics_logger

    def history(prefix: str, name: str) -> list[float]:
        return [float(v) for v in log.get_metric_history(prefix, name, "train")]

    return {
        "dtype": dtype,
        "seed": seed,
        "mismatch_kl": history("actor", "mismatch/kl"),
        "mismatch_abs": history("actor", "mismatch/abs_log_ratio"),
        "clip_fraction": history("actor", "mismatch/clip_fraction"),
        "exact_fraction": history("actor", "mismatch/exact_fraction"),
        "loss_scale": history("actor", "loss_scale/loss_scale"),
        "skipped": history("actor", "loss_scale/skipped"),
        "grad_norm": history("actor", "grad_norm"),
        "reward": history("rewards", "score/mean"),
        "seconds_per_step": seconds / size.steps,
    }


def _mean_sd(values: Sequence[float], fmt: str) -> str:
    values = np.asarray(values, np.float64)
    return f"{values.mean():{fmt}} ± {values.std():{fmt}}"


def table(runs: list[dict[str, Any]]) -> str:
    """Per dtype over the seeds: the mismatch (mean over steps), reward, skips, time."""
    lines = [
        "| compute dtype | loss scale | KL(rollout ‖ trainer) | mean abs log-ratio | "
        "clipped before the update | bit for bit | reward, last step | skipped steps | "
        "s / step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for dtype in DTYPES:
        rows = [r for r in runs if r["dtype"] == dtype]
        if not rows:
            continue
        lines.append(
            f"| {dtype} | {'precision_rl' if dtype == 'float16' else 'none'} | "
            f"{_mean_sd([np.mean(r['mismatch_kl']) for r in rows], '.2e')} | "
            f"{_mean_sd([np.mean(r['mismatch_abs']) for r in rows], '.2e')} | "
            f"{_mean_sd([np.mean(r['clip_fraction']) for r in rows], '.4f')} | "
            f"{_mean_sd([np.mean(r['exact_fraction']) for r in rows], '.2f')} | "
            f"{_mean_sd([r['reward'][-1] for r in rows], '.3f')} | "
            f"{sum(int(sum(r['skipped'])) for r in rows)} | "
            f"{np.mean([r['seconds_per_step'] for r in rows]):.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--quick", action="store_true", help="the test suite's size")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument(
        "--out", type=pathlib.Path, default=None, help="write results.json"
    )
    args = parser.parse_args(argv)
    size = SIZES["quick" if args.quick else args.size]
    seeds = 1 if args.quick else args.seeds
    weights, losses = pretrain(size)
    first, last = losses[0], losses[-1]
    print(f"pretrained {size.pretrain_steps} steps: loss {first:.3f} -> {last:.3f}")
    runs = [
        grpo(size, weights, dtype, seed)
        for seed in range(seeds)
        for dtype in args.dtypes.split(",")
    ]
    print(table(runs))
    result = {"size": dataclasses.asdict(size), "pretrain_loss": losses, "runs": runs}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "train_tunix_grpo.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
