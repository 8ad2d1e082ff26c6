"""RL fine-tuning in float16: the rollout/training mismatch, bfloat16 against float16.

Reinforcement-learning fine-tuning of a language model samples text with an
inference path (incremental decoding with a key/value cache) and recomputes the
sampled tokens' log-probabilities in the training step (one forward pass over the
whole sequence). In exact arithmetic the two agree; in a low-precision compute
dtype they differ by rounding, and the importance ratio between them, which the
loss uses, is no longer 1. bfloat16 keeps 8 significant bits, float16 11: the
mismatch in float16 is far smaller, but float16's gradients need a loss scale
(Qi et al., "Defeating the Training-Inference Mismatch via FP16", 2025).

The policy is the main job's character-level GPT (``train_gpt.py``: d_model 64,
2 layers, 4 heads, context 64, GELU MLP, tied embeddings), written here as plain
JAX functions so that the same weights run both paths. It is pretrained briefly
in float32 on the Python Language Reference (``pydoc_data.topics``), then
fine-tuned with GRPO:

- a step samples ``group`` completions of ``gen`` characters for each of
  ``prompts`` prompts (``prompt_len`` characters of the training text; the
  ``Size``'s fields) with the inference path, in the configuration's compute
  dtype, at temperature 1;
- the reward of a completion is the share of its characters that are vowels
  (``aeiou``): a rule a small model learns to raise in a few hundred steps;
- advantages are group-normalised (reward minus the group's mean, over its std);
- the training step recomputes the sampled tokens' log-probs in one forward pass
  (same weights, same compute dtype) and minimises the clipped surrogate
  ``-min(r A, clip(r, 1 - EPS, 1 + EPS) A)``, averaged over the update's tokens,
  where ``r = exp(logp_train - logp_rollout)`` is the importance ratio between the
  training step and the rollout: one update per rollout, so ``r`` is the mismatch.

Each step's batch (``prompts * group * gen`` = 1,024 completion tokens) is one
micro-batch of an update of ``UPDATE_TOKENS`` = 2^20 tokens (512 responses of
2,048 tokens, the size of an RL fine-tuning update of a language model): a token
mean over the update divides each micro-batch's loss by 1,024. The job takes one
micro-batch per step and does not accumulate the others (Adam does not depend on
the gradient's scale, and the clipping threshold is scaled alike); what it
reproduces is the size of the gradients in each micro-batch's backward pass.

Five configurations, the same pretrained weights and, per seed, the same prompts
and sampling keys:

- ``fp32``: float32 compute (``NoScale()``);
- ``bf16``: bfloat16 compute, no loss scale (``NoScale()``);
- ``fp16_noscale``: float16 compute, no loss scale;
- ``fp16_dynamic``: float16 with ``DynamicScale(init_scale=2**16,
  growth_interval=400)`` (PyTorch's ``GradScaler`` defaults with the paper's
  growth interval);
- ``fp16_headroom``: float16 with ``HeadroomScale()``, fed the taps at every
  block's output and the logits (``lsj.taps``).

The compute dtype runs the matmuls on a copy of the float32 master weights; each
matmul sums in float32 and rounds its result to the compute dtype, as a GPU's do;
LayerNorm statistics and the attention softmax are float32, the logits are cast
to float32 for the log-softmax, in both paths. The two paths differ in one kernel,
the attention: the rollout's is FlashAttention's (the unnormalised weights rounded
to the compute dtype, the sum divided out at the end), the training step's
normalises the softmax first. The optimizer is
``lsj.loss_scaling(optax.chain(clip_by_global_norm, adamw), policy)``: the
gradients are unscaled before they are clipped.

Measured per step: the mean reward; the mismatch between the rollout's and the
training step's log-probs of the same tokens (mean ``|logp_train -
logp_rollout|`` and the KL estimate ``mean(r - 1 - log r)``); skipped steps; and,
every ``--probe-every`` steps, the gradient entries lost to underflow (non-zero in
a float32 gradient of the same loss at the same weights and batch, exactly zero
in the configuration's gradient; as in ``train_gpt.py``).

Output in ``OUT`` (default ``out/``): ``rl_results.json`` (one row per
configuration and seed: reward and mismatch averaged over the last quarter of the
steps), ``rl_table.md`` and ``rl_plot.png`` (reward and mismatch per step).

Sizes (``--size``): ``cpu``, the job above (the default); ``gpu``, a policy of
85M parameters (d_model 768, 12 layers, 12 heads, context 128) sampling 8
completions of 96 characters for each of 8 prompts of 32, 24 steps x 2 seeds,
with each path on the backend's own kernels and nothing emulated: the matmuls
in the compute dtype as the backend computes them (float32 at full precision,
not TF32), ``jax.nn.dot_product_attention`` in the training step (cuDNN's
fused attention on a GPU where it applies), and the rollout's decoding loop as
XLA compiles it; its files end ``_gpu`` (``rl_results_gpu.json``). On a GPU
only: a CPU would take hours. ``gpu_tiny`` is the ``gpu`` size's code at the
``cpu`` size's dimensions, to run that code on a CPU.

Run: ``python examples/train_rl.py [--size S] [--steps N] [--seeds K] [--out DIR]
[--quick]``
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import lossscale_jax as lsj

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16

# Pretraining: float32, AdamW, 16 context windows per step.
PRETRAIN_BATCH, PRETRAIN_LR = 16, 3e-3

UPDATE_TOKENS = 2**20  # tokens per optimizer update in LLM RL fine-tuning
EPS = 0.2  # the ratio's clip
LR, WARMUP, CLIP_NORM = 5e-5, 10, 1.0  # CLIP_NORM: the update's gradient norm
VOWELS = "aeiou"

LAST = 0.25  # reward and mismatch: the mean over the last quarter of the steps


@dataclasses.dataclass(frozen=True)
class Size:
    """A size of the job: the model, a step's rollout, the run, and whose kernels."""

    name: str
    d_model: int
    n_layer: int
    n_head: int
    context: int
    prompts: int  # prompts per step
    group: int  # completions per prompt
    prompt_len: int  # characters
    gen: int  # characters per completion
    steps: int  # GRPO steps (default)
    seeds: int  # (default)
    pretrain_steps: int  # (default)
    # True: the kernels written to round as a GPU's do (each matmul sums in float32
    # and rounds its result; the rollout's attention rounds as FlashAttention's), so
    # that a CPU shows the mismatch. False: each path on the backend's own kernels.
    emulated: bool

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def seq(self) -> int:  # prompt and completion, <= context
        return self.prompt_len + self.gen

    @property
    def batch_tokens(self) -> int:  # completion tokens per step
        return self.prompts * self.group * self.gen

    @property
    def loss_weight(self) -> float:  # the step's share of the update's token mean
        return self.batch_tokens / UPDATE_TOKENS


SIZES = {
    # The main job's GPT (110k parameters): 1,024 tokens a step, 160 steps x 3 seeds.
    "cpu": Size("cpu", 64, 2, 4, 64, 4, 8, 8, 32, 160, 3, 200, emulated=True),
    # 85M parameters, 6,144 tokens a step, 24 steps x 2 seeds: a GPU's own kernels.
    "gpu": Size("gpu", 768, 12, 12, 128, 8, 8, 32, 96, 24, 2, 200, emulated=False),
    # The gpu size's code at the cpu size's dimensions (a CPU runs it).
    "gpu_tiny": Size(
        "gpu_tiny", 64, 2, 4, 64, 4, 8, 8, 32, 160, 3, 200, emulated=False
    ),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """A configuration: a compute dtype and a loss-scale policy."""

    name: str
    dtype: Any
    policy: lsj.LossScalePolicy
    taps: bool = False  # the step hands the taps (lsj.taps) to the policy


CONFIGS: tuple[Config, ...] = (
    Config("fp32", F32, lsj.NoScale()),
    Config("bf16", BF16, lsj.NoScale()),
    Config("fp16_noscale", F16, lsj.NoScale()),
    Config(
        "fp16_dynamic", F16, lsj.DynamicScale(init_scale=2.0**16, growth_interval=400)
    ),
    Config("fp16_headroom", F16, lsj.HeadroomScale(), taps=True),
)


# --------------------------------------------------------------------------
# Data.


@functools.cache
def load_corpus() -> tuple[str, np.ndarray]:
    """The characters, and the first 90% of ``pydoc_data.topics`` as ids (train_gpt's
    training text)."""
    from pydoc_data import topics

    text = "".join(topics.topics[k] for k in sorted(topics.topics))
    chars = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(chars)}
    ids = np.fromiter((index[c] for c in text), np.int32, len(text))
    return chars, ids[: int(0.9 * len(ids))]


# --------------------------------------------------------------------------
# Model: plain functions of a dict of float32 weights, applied to a copy of them in
# the compute dtype.


def init_params(size: Size, key: jax.Array, vocab: int) -> dict[str, Any]:
    """GPT-2 initialisation: normal(0.02), residual projections scaled down by
    sqrt(2 n_layer)."""
    d, n_layer = size.d_model, size.n_layer
    keys = iter(jax.random.split(key, 2 + 4 * n_layer))
    std, proj = 0.02, 0.02 / math.sqrt(2 * n_layer)

    def normal(shape, s=std):
        return s * jax.random.normal(next(keys), shape, F32)

    def ln():
        return {"scale": jnp.ones(d, F32), "bias": jnp.zeros(d, F32)}

    def dense(n_in, n_out, s=std):
        return {"kernel": normal((n_in, n_out), s), "bias": jnp.zeros(n_out, F32)}

    blocks = [
        {
            "ln1": ln(),
            "qkv": dense(d, 3 * d),
            "proj": dense(d, d, proj),
            "ln2": ln(),
            "fc": dense(d, 4 * d),
            "fc_proj": dense(4 * d, d, proj),
        }
        for _ in range(n_layer)
    ]
    return {
        "wte": normal((vocab, d)),
        "wpe": normal((size.context, d)),
        "blocks": blocks,
        "ln_f": ln(),
    }


@functools.partial(jax.jit, static_argnums=1)
def cast(tree: Any, dtype: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: a.astype(dtype), tree)


def layer_norm(p, x):
    """Statistics in float32 (as Flax and autocast take them); output in x's dtype."""
    x32 = x.astype(F32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = ((x32 - mean) * lax.rsqrt(var + 1e-5)).astype(x.dtype)
    return y * p["scale"] + p["bias"]


def mm(size: Size, spec, a, b):
    """A matmul in the compute dtype. Emulated: as a GPU computes one, products summed
    in float32 and the result rounded to the compute dtype (XLA on a CPU would
    otherwise sum float16 in float16). Else the backend's own (a GPU's: the same
    arithmetic, in cuBLAS's kernels), float32 at full precision (a GPU's default for
    float32 is TF32, whose 10-bit products would not make float32 the reference)."""
    if size.emulated:
        return jnp.einsum(spec, a, b, preferred_element_type=F32).astype(a.dtype)
    return jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST)


def dense(size: Size, p, x):
    return mm(size, "...i,io->...o", x, p["kernel"]) + p["bias"]


def mlp(size: Size, p, x):
    h = jax.nn.gelu(dense(size, p["fc"], layer_norm(p["ln2"], x)))
    return x + dense(size, p["fc_proj"], h)


def scores_of(q, k, spec):
    """float32 attention scores (the matmul's float32 sums, kept)."""
    return jnp.einsum(spec, q * q.shape[-1] ** -0.5, k, preferred_element_type=F32)


def attend(size: Size, q, k, v):
    """The training path's causal attention; q, k and v (b, t, h, d). Emulated: the
    softmax in float32, normalised, rounded to the compute dtype, times the values.
    Else ``jax.nn.dot_product_attention`` in a 16-bit dtype on an accelerator (cuDNN's
    fused kernel on a GPU where it applies), and otherwise the same written out in the
    compute dtype (float32 at full precision; XLA:CPU refuses float16 dots that sum in
    float32, which the fused function asks for)."""
    if not size.emulated and jax.default_backend() != "cpu" and q.dtype != F32:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    t = q.shape[1]
    mask = jnp.tril(jnp.ones((t, t), bool))
    if size.emulated:
        scores = scores_of(q, k, "bqhd,bkhd->bhqk")
    else:
        scores = mm(size, "bqhd,bkhd->bhqk", q * q.shape[-1] ** -0.5, k).astype(F32)
    att = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1).astype(q.dtype)
    return mm(size, "bhqk,bkhd->bqhd", att, v)


def attend_cached(size: Size, q, k, v, mask):
    """The inference path's attention of one query per sequence over the cache; q
    (b, h, d), k and v (b, context, h, d). Emulated: as FlashAttention computes it, the
    unnormalised weights ``exp(s - max)`` rounded to the compute dtype for the
    weights-times-values matmul, the result divided by the float32 sum of the
    unrounded weights. Else the decoding step's attention written plainly (the scores
    in the compute dtype, the softmax in float32), compiled as the backend does."""
    if not size.emulated:
        s = mm(size, "bhd,bkhd->bhk", q * q.shape[-1] ** -0.5, k).astype(F32)
        att = jax.nn.softmax(jnp.where(mask[:, None, :], s, -jnp.inf), axis=-1)
        return mm(size, "bhk,bkhd->bhd", att.astype(q.dtype), v)
    scores = jnp.where(mask[:, None, :], scores_of(q, k, "bhd,bkhd->bhk"), -jnp.inf)
    w = jnp.exp(scores - scores.max(-1, keepdims=True))
    out = jnp.einsum("bhk,bkhd->bhd", w.astype(q.dtype), v, preferred_element_type=F32)
    return (out / w.sum(-1)[..., None]).astype(q.dtype)


def logits_of(size: Size, params, x):
    """The logits of the tied output embedding, in x's dtype (tapped there), then cast
    to float32 for the softmax."""
    logits = mm(size, "...d,vd->...v", layer_norm(params["ln_f"], x), params["wte"])
    return lsj.tap(logits, "logits").astype(F32)


def forward(size: Size, params, tokens):
    """The training path: float32 logits (batch, T, vocab), one pass over ``tokens``.

    Each block's output and the logits are tapped (``lsj.tap``: the identity outside
    ``lsj.taps.value_and_grad``).
    """
    t = tokens.shape[-1]
    x = params["wte"][tokens] + params["wpe"][:t]
    for i, p in enumerate(params["blocks"]):
        b, _, d = x.shape
        qkv = dense(size, p["qkv"], layer_norm(p["ln1"], x))
        qkv = qkv.reshape(b, t, 3, size.n_head, size.head_dim)
        y = attend(size, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]).reshape(b, t, d)
        x = lsj.tap(mlp(size, p, x + dense(size, p["proj"], y)), f"block{i}")
    return logits_of(size, params, x)


def decode_step(size: Size, params, cache, token, pos):
    """The inference path: one token per sequence at position ``pos``, attending to the
    key/value cache (``(layers, 2, batch, context, heads, head_dim)``); returns the
    float32 logits of the next token and the updated cache."""
    x = params["wte"][token] + params["wpe"][pos]  # (batch, d)
    mask = (jnp.arange(size.context) <= pos)[None, :]
    for i, p in enumerate(params["blocks"]):
        qkv = dense(size, p["qkv"], layer_norm(p["ln1"], x))
        q, k, v = jnp.split(qkv, 3, axis=-1)
        heads = (x.shape[0], 1, size.n_head, size.head_dim)
        kv = jnp.stack([k.reshape(heads), v.reshape(heads)])
        cache = cache.at[i].set(lax.dynamic_update_slice_in_dim(cache[i], kv, pos, 2))
        y = attend_cached(size, q.reshape(heads)[:, 0], cache[i, 0], cache[i, 1], mask)
        y = y.reshape(x.shape)
        x = mlp(size, p, x + dense(size, p["proj"], y))
    return logits_of(size, params, x), cache


# --------------------------------------------------------------------------
# Pretraining (float32): the policy every configuration starts from.


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def pretrain(size: Size, vocab: int, steps: int, tokens: jax.Array, key: jax.Array):
    """``(params, losses)``: ``steps`` AdamW steps of next-character prediction."""
    k_init, k_data = jax.random.split(key)
    params = init_params(size, k_init, vocab)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, PRETRAIN_LR, min(20, steps // 2), steps, PRETRAIN_LR / 30
    )
    tx = optax.adamw(schedule, b2=0.99, weight_decay=0.1)
    context = size.context
    high = tokens.shape[0] - context - 1
    starts = jax.random.randint(k_data, (steps, PRETRAIN_BATCH), 0, high)

    def step(carry, offsets):
        params, opt_state = carry
        w = tokens[offsets[:, None] + jnp.arange(context + 1)]

        def loss_fn(p):
            logits = forward(size, p, w[:, :-1])
            xent = optax.softmax_cross_entropy_with_integer_labels(logits, w[:, 1:])
            return xent.mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    (params, _), losses = lax.scan(step, (params, tx.init(params)), starts)
    return params, losses


# --------------------------------------------------------------------------
# The rollout (inference path) and the training step (training path).


class Batch(NamedTuple):
    """One step's rollout: what the inference engine hands to the trainer."""

    seq: jax.Array  # (n, seq) int32: prompt and completion
    logp_rollout: jax.Array  # (n, gen) float32: the completion's log-probs, rollout
    advantage: jax.Array  # (n,) float32: group-normalised reward
    reward: jax.Array  # () float32: the mean reward of the step's completions


@functools.partial(jax.jit, static_argnums=(0, 1))
def rollout(size: Size, dtype, params, tokens, offsets, key, vowels) -> Batch:
    """``group`` completions per prompt, sampled with the key/value cache in ``dtype``.

    The prompts are ``prompt_len`` characters of ``tokens`` at ``offsets``; sampling
    is at temperature 1 from the float32 logits; ``vowels`` is 1.0 for the vowels'
    ids, 0.0 for the other characters.
    """
    p = cast(params, dtype)
    prompts = tokens[offsets[:, None] + jnp.arange(size.prompt_len)]
    n = size.prompts * size.group
    seq = jnp.zeros((n, size.seq), jnp.int32)
    seq = seq.at[:, : size.prompt_len].set(jnp.repeat(prompts, size.group, axis=0))
    heads = (size.n_head, size.head_dim)
    cache = jnp.zeros((size.n_layer, 2, n, size.context, *heads), dtype)

    def body(carry, xs):
        seq, cache = carry
        pos, k = xs  # feed the token at pos, predict the one at pos + 1
        logits, cache = decode_step(size, p, cache, seq[:, pos], pos)
        sampled = jax.random.categorical(k, logits).astype(jnp.int32)
        fed = pos + 1 < size.prompt_len  # the prompt is fed, not sampled
        nxt = jnp.where(fed, seq[:, pos + 1], sampled)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), nxt[:, None], -1)
        return (seq.at[:, pos + 1].set(nxt), cache), logp[:, 0]

    xs = (jnp.arange(size.seq - 1), jax.random.split(key, size.seq - 1))
    (seq, _), logp = lax.scan(body, (seq, cache), xs)
    reward = vowels[seq[:, size.prompt_len :]].mean(-1)
    reward = reward.reshape(size.prompts, size.group)
    centred = reward - reward.mean(-1, keepdims=True)
    advantage = centred / (reward.std(-1, keepdims=True) + 1e-6)
    logp = logp.T[:, size.prompt_len - 1 :]
    return Batch(seq, logp, advantage.reshape(-1), reward.mean())


def token_logp(size: Size, params, seq):
    """The training path's float32 log-probs of the completions' tokens, (n, gen)."""
    logp = jax.nn.log_softmax(forward(size, params, seq[:, :-1]))
    logp = jnp.take_along_axis(logp, seq[:, 1:, None], -1)[..., 0]
    return logp[:, size.prompt_len - 1 :]


def grpo_loss(size: Size, params, batch: Batch):
    """``(loss, logp)``: the clipped surrogate's token mean times the step's share of
    the update (``size.loss_weight``)."""
    logp = token_logp(size, params, batch.seq)
    ratio = jnp.exp(logp - batch.logp_rollout)  # training / rollout
    a = batch.advantage[:, None]
    surrogate = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - EPS, 1 + EPS) * a)
    return -surrogate.mean() * size.loss_weight, logp


def gradients(size: Size, dtype, taps, params, batch, opt_state):
    """``(grads, logp, taps)``: the gradient of the scaled loss with respect to the
    ``dtype`` copy of ``params``, the training path's log-probs, the taps (or None)."""

    def scaled_loss(p):
        loss, logp = grpo_loss(size, p, batch)
        return lsj.scale_loss(loss, opt_state), logp

    p16 = cast(params, dtype)
    if taps:
        (_, logp), grads, stats = lsj.taps.value_and_grad(scaled_loss, has_aux=True)(
            p16
        )
        return grads, logp, stats
    grads, logp = jax.grad(scaled_loss, has_aux=True)(p16)
    return grads, logp, None


@functools.cache
def make_tx(size: Size, config: Config) -> optax.GradientTransformationExtraArgs:
    """Clipping and AdamW inside ``loss_scaling``: the gradients are clipped unscaled.

    Cached: one object per size and configuration, so its jitted step compiles once.
    """
    inner = optax.chain(
        optax.clip_by_global_norm(CLIP_NORM * size.loss_weight),
        optax.adamw(optax.linear_schedule(0.0, LR, WARMUP), b2=0.99, weight_decay=0.0),
    )
    return lsj.loss_scaling(inner, config.policy)


@functools.partial(jax.jit, static_argnums=(0, 1))
def train_step(size: Size, config: Config, params, opt_state, batch: Batch):
    """One GRPO update: ``(params, opt_state, grads, metrics)``.

    ``grads`` is the step's own gradient (compute dtype, scaled), for the probe;
    ``metrics``: the mismatch between the rollout's and the training path's log-probs
    of the same tokens (``kl``: mean(r - 1 - log r), ``abs``: mean |log r|, r =
    p_train / p_rollout), the scale the step used and whether it was skipped.
    """
    scale = lsj.get_loss_scale_state(opt_state).scale
    grads, logp, taps = gradients(
        size, config.dtype, config.taps, params, batch, opt_state
    )
    updates, opt_state = make_tx(size, config).update(
        grads, opt_state, params, taps=taps
    )
    log_ratio = logp - batch.logp_rollout
    metrics = dict(
        kl=jnp.mean(jnp.expm1(log_ratio) - log_ratio),
        abs=jnp.mean(jnp.abs(log_ratio)),
        scale=scale,
        skipped=lsj.get_loss_scale_state(opt_state).last_skipped,
    )
    return optax.apply_updates(params, updates), opt_state, grads, metrics


@functools.partial(jax.jit, static_argnums=0)
def reference_gradients(size: Size, params, batch: Batch):
    """The float32 gradient of the same loss (float32 compute, no scale)."""
    return gradients(size, F32, False, params, batch, lsj.NoScale().init())[0]


@jax.jit
def lost_entries(g: Any, g32: Any) -> tuple[jax.Array, jax.Array]:
    """(#entries zero in ``g`` but not in ``g32``, #entries non-zero in ``g32``)."""
    pairs = zip(
        jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g32), strict=True
    )
    lost = sum(jnp.sum((a == 0) & (b != 0), dtype=jnp.int32) for a, b in pairs)
    leaves = jax.tree_util.tree_leaves(g32)
    return lost, sum(jnp.sum(b != 0, dtype=jnp.int32) for b in leaves)


# --------------------------------------------------------------------------
# The job.


def prompt_offsets(size: Size, seed: int, steps: int, n: int) -> jax.Array:
    """(steps, prompts) start offsets of the prompts in the ``n`` training characters,
    alike for every configuration."""
    rng = np.random.default_rng(seed)
    shape = (steps, size.prompts)
    return jnp.asarray(rng.integers(0, n - size.prompt_len, shape, np.int32))


def sample_keys(seed: int, steps: int) -> jax.Array:
    """One sampling key per step, alike for every configuration."""
    return jax.random.split(jax.random.key(seed), steps)


def compile_in_parallel(lowered: Sequence[Any], workers: int = 2) -> None:
    """Compiles lowered jitted calls on ``workers`` threads (XLA: one core per call)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda low: low.compile(), lowered))


def run(
    steps: int,
    seeds: int,
    probe_every: int,
    pretrain_steps: int | None = None,
    progress: bool = True,
    size: Size = SIZES["cpu"],
) -> dict[str, Any]:
    """Pretrains the policy (``size.pretrain_steps`` where None), then fine-tunes it
    with every configuration and seed. Without the progress bar, a line per stage (the
    compilation, the pretraining, each configuration and seed) says what is done and
    when, so a run cut at a time limit still shows how far it got."""
    from tqdm.auto import tqdm

    start = time.perf_counter()

    def done(what: str) -> None:
        if not progress:
            print(f"[{time.perf_counter() - start:6.1f} s] {what}", flush=True)

    if pretrain_steps is None:
        pretrain_steps = size.pretrain_steps
    chars, train = load_corpus()
    vocab = len(chars)
    tokens = jnp.asarray(train)
    vowels = jnp.asarray([c in VOWELS for c in chars], F32)
    offsets = [prompt_offsets(size, seed, steps, len(train)) for seed in range(seeds)]
    keys = [sample_keys(seed, steps) for seed in range(seeds)]

    # Compile every step function (two at a time, or one per four cores) while the
    # policy pretrains.
    params0 = jax.eval_shape(
        functools.partial(init_params, size, vocab=vocab), jax.random.key(0)
    )
    first = (tokens, offsets[0][0], keys[0][0], vowels)
    batches = {
        d: jax.eval_shape(rollout, size, d, params0, *first)
        for d in dict.fromkeys([F32] + [c.dtype for c in CONFIGS])
    }
    lowered = []
    if pretrain_steps:
        lowered.append(
            pretrain.lower(size, vocab, pretrain_steps, tokens, jax.random.key(0))
        )
    lowered += [
        rollout.lower(size, d, params0, *first)
        for d in dict.fromkeys(c.dtype for c in CONFIGS)
    ]
    for c in CONFIGS:
        opt0 = jax.eval_shape(make_tx(size, c).init, params0)
        lowered.append(train_step.lower(size, c, params0, opt0, batches[c.dtype]))
    lowered.append(reference_gradients.lower(size, params0, batches[F32]))
    lowered += [
        lost_entries.lower(jax.eval_shape(cast, params0, d), params0)
        for d in batches
        if d != F32
    ]
    compile_in_parallel(lowered, max(2, (os.cpu_count() or 2) // 4))
    done(f"compiled {len(lowered)} programs")

    if pretrain_steps:
        params0, pre_losses = pretrain(
            size, vocab, pretrain_steps, tokens, jax.random.key(0)
        )
    else:  # --pretrain-steps 0: the initial weights (the loss of a uniform guess)
        params0 = init_params(size, jax.random.split(jax.random.key(0))[0], vocab)
        pre_losses = np.full(1, math.log(vocab))
    jax.block_until_ready(params0)
    done(f"pretrained {pretrain_steps} steps")
    bar = tqdm(
        total=len(CONFIGS) * seeds * steps,
        unit="step",
        disable=not progress,
        dynamic_ncols=True,
        mininterval=0.5,
    )
    results: dict[str, list[dict[str, np.ndarray]]] = {}
    for config in CONFIGS:
        bar.set_description(config.name)
        results[config.name] = []
        for seed in range(seeds):
            params, opt_state = params0, make_tx(size, config).init(params0)
            h: dict[str, list] = {k: [] for k in ("reward", "lost", "nonzero")}
            for t in range(steps):
                batch = rollout(
                    size,
                    config.dtype,
                    params,
                    tokens,
                    offsets[seed][t],
                    keys[seed][t],
                    vowels,
                )
                before = params
                params, opt_state, grads, m = train_step(
                    size, config, params, opt_state, batch
                )
                h["reward"].append(batch.reward)
                for k, v in m.items():
                    h.setdefault(k, []).append(v)
                if t % probe_every == 0 and config.dtype != F32:
                    lost, nonzero = lost_entries(
                        grads, reference_gradients(size, before, batch)
                    )
                    h["lost"].append(lost)
                    h["nonzero"].append(nonzero)
                if (t + 1) % 10 == 0 or t + 1 == steps:
                    jax.block_until_ready(params)
                    bar.update((t % 10) + 1)
            results[config.name].append(
                {k: np.asarray(jax.device_get(v)) for k, v in h.items()}
            )
            done(f"{config.name}, seed {seed}: {steps} steps")
    bar.close()
    return dict(
        size=size,
        param_count=sum(int(x.size) for x in jax.tree_util.tree_leaves(params0)),
        results=results,
        steps=steps,
        seeds=seeds,
        probe_every=probe_every,
        params=params0,
        pretrain_loss=float(np.mean(np.asarray(pre_losses)[-20:])),
        pretrain_steps=pretrain_steps,
    )


def result_rows(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON rows: one per configuration and seed."""
    last = max(1, round(LAST * job["steps"]))
    rows = []
    for config in CONFIGS:
        for seed, h in enumerate(job["results"][config.name]):
            lost, nonzero = int(np.sum(h["lost"])), int(np.sum(h["nonzero"]))
            rows.append(
                dict(
                    config=config.name,
                    seed=seed,
                    final_reward=float(h["reward"][-last:].mean()),
                    mismatch_kl=float(h["kl"][-last:].mean()),
                    mismatch_abs=float(h["abs"][-last:].mean()),
                    skipped_fraction=float(h["skipped"].mean()),
                    lost_fraction=None
                    if config.dtype == F32
                    else lost / max(nonzero, 1),
                )
            )
    return rows


def _mean_std(values: Sequence[float], fmt: str = ".3f") -> str:
    v = np.asarray(values, np.float64)
    std = v.std(ddof=1) if len(v) > 1 else 0.0
    return f"{v.mean():{fmt}} ± {std:{fmt}}"


def _by_config(rows: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return sorted((r for r in rows if r["config"] == name), key=lambda r: r["seed"])


SCALED = ("fp16_dynamic", "fp16_headroom")  # float16 with a loss scale


def targets(rows: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """The job's targets, each ``(what was measured, whether it met the target)``."""
    bf16 = _by_config(rows, "bf16")
    fp32 = [r["final_reward"] for r in _by_config(rows, "fp32")]
    spread = float(np.std(fp32, ddof=1)) if len(fp32) > 1 else 0.0
    noscale = _by_config(rows, "fp16_noscale")
    out = []
    for name in SCALED:
        mine = _by_config(rows, name)
        ratios = [
            b["mismatch_kl"] / r["mismatch_kl"] for b, r in zip(bf16, mine, strict=True)
        ]
        out.append(
            (
                f"{name}: mismatch KL at most 1/4 of bf16's in every seed: bf16's is "
                f"{min(ratios):.0f}x-{max(ratios):.0f}x larger",
                min(ratios) >= 4,
            )
        )
        reward = np.mean([r["final_reward"] for r in mine])
        ref = np.mean([r["final_reward"] for r in bf16])
        skipped = max(r["skipped_fraction"] for r in mine)
        out.append(
            (
                f"{name}: final reward {reward:.3f} against bf16's {ref:.3f} (no worse "
                f"than bf16 by more than fp32's seed spread, {spread:.3f}); skipped "
                f"steps at most {100 * skipped:.1f}% per seed (target <= 2%)",
                bool(reward >= ref - spread and skipped <= 0.02),
            )
        )
        lost = np.mean([r["lost_fraction"] for r in mine])
        unscaled = np.mean([r["lost_fraction"] for r in noscale])
        ratio = f"{unscaled / lost:.0f}x" if lost > 0 else "all"
        out.append(
            (
                f"fp16_noscale loses {100 * unscaled:.3g}% of the gradient entries, "
                f"{name} {100 * lost:.3g}%: {ratio} (target >= 5x)",
                bool(unscaled >= 5 * lost),
            )
        )
    return out


def format_table(rows: list[dict[str, Any]], job: dict[str, Any]) -> str:
    """Mean ± std over seeds per configuration, the targets, then what was run."""
    steps, seeds, size = job["steps"], job["seeds"], job["size"]
    last = max(1, round(LAST * steps))
    described = ""
    if size.name != "cpu":
        described = (
            f"of {job['param_count']:,} parameters (d_model {size.d_model}, "
            f"{size.n_layer} layers; size {size.name}) "
        )
    bf16 = {r["seed"]: r["mismatch_kl"] for r in _by_config(rows, "bf16")}
    lines = [
        f"| config | reward (last {last} steps) | mismatch KL (last {last} steps) | "
        "bf16's KL / this (min-max over seeds) | mean abs(delta logp) | skipped steps "
        "| entries lost to underflow (min-max) | final scale |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for config in CONFIGS:
        rs = _by_config(rows, config.name)
        kl = [r["mismatch_kl"] for r in rs]
        ratio = [bf16[r["seed"]] / r["mismatch_kl"] for r in rs]
        if config.dtype == F32:
            lost = "reference"
        else:
            pct = [100 * r["lost_fraction"] for r in rs]
            lost = f"{np.mean(pct):.3g}% ({min(pct):.3g}-{max(pct):.3g})"
        scales = sorted({h["scale"][-1] for h in job["results"][config.name]})
        lines.append(
            f"| {config.name} | {_mean_std([r['final_reward'] for r in rs])} "
            f"| {np.mean(kl):.2e} ({min(kl):.1e}-{max(kl):.1e}) "
            f"| {min(ratio):.3g}-{max(ratio):.3g} "
            f"| {np.mean([r['mismatch_abs'] for r in rs]):.2e} "
            f"| {100 * np.mean([r['skipped_fraction'] for r in rs]):.1f}% "
            f"| {lost} | {', '.join(f'{s:g}' for s in scales)} |"
        )
    plural = "s" if seeds != 1 else ""
    lines += ["", "Targets:", ""]
    lines += [f"- {'met' if ok else 'NOT met'}: {text}" for text, ok in targets(rows)]
    lines += [
        "",
        f"{steps} GRPO steps, {seeds} seed{plural}, mean ± std over seeds; each step "
        f"{size.prompts} prompts x {size.group} completions of {size.gen} characters "
        f"({size.batch_tokens:,} tokens), from a policy {described}pretrained for "
        f"{job['pretrain_steps']} steps (float32, train loss "
        f"{job['pretrain_loss']:.2f}). Reward: the share of vowels in the completion. "
        "Mismatch: between the rollout's (key/value cache) and the training step's "
        "(full forward) log-probs of the same tokens, KL = mean(r - 1 - log r). "
        "Entries lost: non-zero in a float32 gradient, zero in the config's "
        f"(same weights and batch), counted every {job['probe_every']} steps.",
        "",
    ]
    lines += [
        f"- {c.name}: {jnp.dtype(c.dtype).name} compute, {c.policy}"
        + (", taps" if c.taps else "")
        for c in CONFIGS
    ]
    return "\n".join(lines)


def _smooth(x: np.ndarray, k: int = 10) -> np.ndarray:
    k = max(1, min(k, len(x)))
    c = np.cumsum(np.insert(np.asarray(x, np.float64), 0, 0.0))
    head = c[1:k] / np.arange(1, k)  # growing window over the first k - 1 steps
    return np.concatenate([head, (c[k:] - c[:-k]) / k])


def plot(job: dict[str, Any], path: pathlib.Path) -> None:
    """Reward and mismatch against step, one line per configuration (seeds' mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_kl) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    dashes = ["-", "-", "--", ":", "-."]  # lines on top of each other stay visible
    for i, config in enumerate(CONFIGS):
        hist = job["results"][config.name]
        reward = np.mean([h["reward"] for h in hist], axis=0)
        kl = np.mean([h["kl"] for h in hist], axis=0)
        if config.dtype == F32:  # the reference, thick and grey behind the others
            style = dict(color="0.6", lw=4, label=config.name)
        else:
            style = dict(color=colors[i], ls=dashes[i % 5], lw=1.6, label=config.name)
        ax_r.plot(_smooth(reward), **style)
        ax_kl.plot(_smooth(kl), **style)
    ax_r.set_ylabel("reward: share of vowels\n(10-step running mean)")
    ax_kl.set_ylabel("rollout/training mismatch KL\n(10-step running mean)")
    ax_kl.set_yscale("log")
    for ax in (ax_r, ax_kl):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    seeds = job["seeds"]
    fig.suptitle(
        f"GRPO fine-tuning of a char-level GPT, mean of {seeds} seed"
        f"{'s' if seeds != 1 else ''}: reward and train/rollout mismatch per dtype"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="cpu",
        help="cpu: the GPT of 110k parameters, emulated GPU rounding (default); gpu: "
        "85M parameters on a GPU's own kernels; gpu_tiny: that code at the cpu size",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="GRPO steps (default: the size's)"
    )
    p.add_argument(
        "--seeds", type=int, default=None, help="seeds (default: the size's)"
    )
    p.add_argument(
        "--pretrain-steps",
        type=int,
        default=None,
        help="float32 pretraining steps (default: the size's)",
    )
    p.add_argument(
        "--probe-every",
        type=int,
        default=10,
        help="count the entries lost to underflow every N steps (default 10)",
    )
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("out"),
        help="output folder (default out/)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short run for the test suite (8 steps, 2 seeds, no pretraining)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    size = args.size = SIZES[args.size]
    if args.steps is None:
        args.steps = 8 if args.quick else size.steps
    if args.seeds is None:
        args.seeds = 2 if args.quick else size.seeds
    if args.pretrain_steps is None:
        args.pretrain_steps = 0 if args.quick else size.pretrain_steps
    least = dict(steps=1, seeds=1, pretrain_steps=0, probe_every=1)
    for name, low in least.items():
        if getattr(args, name) < low:
            flag = name.replace("_", "-")
            p.error(f"--{flag} must be >= {low}, got {getattr(args, name)}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t0, c0 = time.perf_counter(), time.process_time()
    args.out.mkdir(parents=True, exist_ok=True)
    job = run(
        args.steps,
        args.seeds,
        args.probe_every,
        pretrain_steps=args.pretrain_steps,
        progress=not args.no_progress,
        size=args.size,
    )
    rows = result_rows(job)
    table = format_table(rows, job)
    end = "" if args.size.name == "cpu" else f"_{args.size.name}"
    results = args.out / f"rl_results{end}.json"
    results.write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / f"rl_table{end}.md").write_text(table + "\n")
    plot(job, args.out / f"rl_plot{end}.png")
    print(table)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(
        f"\nwrote {results}, rl_table{end}.md and rl_plot{end}.png in "
        f"{wall:.0f} s ({cpu:.0f} s of CPU time) on {jax.devices()[0].device_kind}"
    )
    return dict(job=job, rows=rows, table=table, out=args.out, wall_s=wall, cpu_s=cpu)


if __name__ == "__main__":
    main()
