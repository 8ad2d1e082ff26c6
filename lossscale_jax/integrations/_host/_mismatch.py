"""The rollout/trainer mismatch: the sampled tokens' log-probs as the rollout gave them
against those the trainer recomputes, before any update.

The rollout samples with its own kernels (a key/value-cache decode); the training step
recomputes the log-probs with a full forward pass. Their gap is the mismatch that float16
with a loss scale shrinks against bfloat16 (Qi et al. 2025). :func:`mismatch` computes, over
the sampled tokens the rollout gave a log-prob for (``d = logp_trainer - logp_rollout``):
``mismatch/kl`` = mean(exp(d) - 1 - d) (the k3 estimate of KL(rollout || trainer)),
``mismatch/abs_log_ratio`` = mean |d|, ``mismatch/max_abs_log_ratio``,
``mismatch/clip_fraction`` (the share whose ratio ``exp(d)`` lies outside the learner's clip
range before any update) and ``mismatch/exact_fraction`` (the share whose float32 log-probs
agree bit for bit). ``METRICS`` says how a host reduces each over a step's micro-batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lossscale_jax.engine._ops import where

METRICS = {
    "mismatch/kl": np.mean,
    "mismatch/abs_log_ratio": np.mean,
    "mismatch/max_abs_log_ratio": np.max,
    "mismatch/clip_fraction": np.mean,
    "mismatch/exact_fraction": np.mean,
}


def mismatch(
    logp_trainer: jax.Array,
    logp_rollout: jax.Array,
    mask: jax.Array,
    clip: tuple[float, float],
) -> dict[str, jax.Array]:
    """The mismatch metrics over the tokens ``mask`` marks where the rollout gave a finite
    log-prob; ``clip = (low, high)``: the ratio's clip range ``[1 - low, 1 + high]``."""
    seen = jnp.logical_and(mask.astype(bool), jnp.isfinite(logp_rollout))
    trainer = logp_trainer.astype(jnp.float32)
    rollout = logp_rollout.astype(jnp.float32)
    d = where(seen, trainer - rollout, 0.0)
    ratio = jnp.exp(d)
    low, high = clip
    clipped = jnp.logical_or(ratio < 1.0 - low, ratio > 1.0 + high)
    bits = jax.lax.bitcast_convert_type
    same = bits(trainer, jnp.int32) == bits(rollout, jnp.int32)
    count = jnp.maximum(jnp.sum(seen), 1).astype(jnp.float32)

    def share(flags: jax.Array) -> jax.Array:
        return jnp.sum(jnp.logical_and(seen, flags)) / count

    return {
        "mismatch/kl": jnp.sum(jnp.expm1(d) - d) / count,
        "mismatch/abs_log_ratio": jnp.sum(jnp.abs(d)) / count,
        "mismatch/max_abs_log_ratio": jnp.max(jnp.abs(d)),
        "mismatch/clip_fraction": share(clipped),
        "mismatch/exact_fraction": share(same),
    }
