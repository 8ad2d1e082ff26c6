"""The main job: a small GPT on real text, float32 vs float16, with and without scaling.

A nanoGPT-style character-level language model (d_model 64, 2 layers, 4 heads,
context 64, GELU MLP, tied embeddings, GPT-2 initialisation) learns the Python
Language Reference text that ships with Python (``pydoc_data.topics``, the text
behind ``help()``; no download; it varies a little with the Python version).
The first 90% of the text trains, the last 10% validates.

Two settings, two normalisations of the loss on the same 1,024-token
micro-batches (16 sequences of 64 characters):

- ``mean``: the plain mean token cross-entropy of the micro-batch;
- ``update_2^19``: one micro-batch of a 2**19-token update per optimizer step.
  Under gradient accumulation, GPT-2-scale training divides each micro-batch's
  loss by the update's token count (as nanoGPT and the Hugging Face trainer
  normalise it), so each 1,024-token micro-batch's loss is its mean / 512.
  This job takes one such micro-batch per step and does **not** accumulate the
  other 511 (Adam does not depend on the gradient's scale, so float32 trains
  as in ``mean``); what it reproduces is the size of the gradients in each
  micro-batch's float16 backward pass, which is where underflow happens.

Five configurations (``CONFIGS``; another policy is one more entry), the same
seeds, initial weights and batches for all of them:

- ``fp32``: float32 compute, the reference (``NoScale()``);
- ``fp16``: float16 compute, no loss scale (``NoScale()``);
- ``fp16_static``: float16 with ``StaticScale(1024)``;
- ``fp16_dynamic``: float16 with ``DynamicScale(init_scale=2**19,
  growth_interval=25, backoff_factor=0.25, max_scale=inf)``;
- ``fp16_headroom``: float16 with ``HeadroomScale(max_scale=inf)``: the scale set
  from the measured range of the gradients and of the activation gradients at the
  blocks' outputs (``lsj.taps``), one octave below it, without probing overflows.

float16 means: the matmuls run in float16 on a float16 copy of the float32
master weights, LayerNorm statistics and the attention softmax in float32 (as
autocast does), the logits are cast to float32 for the cross-entropy, and the
gradients are taken with respect to the float16 copy. Every configuration is a
``lsj.TrainState`` around ``lsj.loss_scaling(optax.adamw(schedule), policy)``.
A row (a setting and a seed) is one train state; the rows of a configuration
run one after another through the same compiled functions.

Every ``--probe-every`` steps the job counts the gradient entries lost to
underflow: entries that are non-zero in a float32 reference gradient (float32
compute, same float32 weights, same batch, same loss) but exactly zero in the
configuration's float16 gradient of that step.

Before training, the job prints ``lsj.diagnose``'s table for the model in the
``update_2^19`` setting (seed 0's initial weights, the first ``DIAGNOSIS_BATCHES``
micro-batches of seed 0, loss scales 2^0 to 2^30, the dynamic policy's initial
2^19 as the scale in use): per parameter, what float16's backward pass loses and
the range of initial scales that neither overflows nor loses gradient.

Output in ``OUT`` (default ``out/``): ``gpt_results.json`` (one row per
setting, configuration and seed), ``gpt_table.md`` (mean ± std over seeds),
``gpt_plot.png`` (loss curves, float32 behind each float16 panel; the loss scale
with skipped steps marked), ``gpt_samples.txt`` (generated text),
``gpt_diagnosis.txt`` (the diagnosis table) and ``gpt_diagnosis.png`` (its
picture: log2|g| against float16's range, shifted by the recommended scale).

Run: ``python examples/train_gpt.py [--steps N] [--seeds K] [--out DIR] [--quick]``
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import lossscale_jax as lsj

F16, F32 = jnp.float16, jnp.float32

# Model (nanoGPT-style, character level).
D_MODEL, N_LAYER, N_HEAD, CONTEXT = 64, 2, 4, 64
BATCH = 16  # sequences per micro-batch
TOKENS = BATCH * CONTEXT  # 1,024 tokens per micro-batch
UPDATE_TOKENS = 2**19  # tokens per optimizer update in GPT-2-scale training

# Optimizer: AdamW, linear warm-up then cosine decay (over the run's steps).
LR, LR_END, WARMUP, B2, WEIGHT_DECAY = 1e-3, 1e-4, 20, 0.99, 0.1

STEPS = 250  # optimizer steps per run (the default)
TRAIN_LOSS_LAST = 25  # the table's train loss is the mean of the last 25 steps
GUIDELINE = 0.005  # keep skipped steps under 0.5%
VAL_WINDOWS = 256  # validation: 256 windows of 64 predictions (16,384 tokens)
PROMPT, SAMPLE_LENGTH, TEMPERATURE = (
    "The ",
    240,
    0.5,
)  # generated text, per configuration
# The diagnosis before training: micro-batches, and the loss scales tried (2^0 .. 2^30:
# the static 2^10, the dynamic 2^19 and the ceiling near 2^27 are inside). --quick: 1
# batch, every other power of two.
DIAGNOSIS_BATCHES = 4
DIAGNOSIS_SCALES = 2.0 ** np.arange(0, 31)


# --------------------------------------------------------------------------
# Settings and configurations.


@dataclasses.dataclass(frozen=True)
class Setting:
    """How the loss is normalised: the differentiated loss is ``loss_weight * mean``."""

    name: str
    loss_weight: float
    description: str


SETTINGS: tuple[Setting, ...] = (
    Setting("mean", 1.0, f"the plain mean over the step's {TOKENS:,} tokens"),
    Setting(
        "update_2^19",
        TOKENS / UPDATE_TOKENS,
        f"one {TOKENS:,}-token micro-batch of a 2^19-token update per step: "
        f"loss = micro-batch mean / {UPDATE_TOKENS // TOKENS}, no accumulation",
    ),
)


@dataclasses.dataclass(frozen=True)
class Config:
    """A configuration: a compute dtype and a loss-scale policy (optimizer: per run)."""

    name: str
    dtype: Any
    policy: lsj.LossScalePolicy
    taps: bool = False  # the step hands the blocks' taps (lsj.taps) to the policy


STATIC_SCALE = 2.0**10
# Dynamic: chosen so that, in the 250-step run, the scale climbs to its ceiling in
# update_2^19 (there 2**28 overflows on about every other batch, 2**27 on about one in
# seventy) and backs off once: 2**19 grown x2 every 25 good steps reaches 2**27 at step
# 200 and 2**28 at step 225. A backoff by 4 (not 2) drops it below the ceiling's
# batch-to-batch spread, and two growths (50 steps) would be needed to come back, so the
# run ends before a second overflow. No cap: the default max_scale, 2**24, would hold
# the scale below the ceiling and no backoff would happen.
DYNAMIC = lsj.DynamicScale(
    init_scale=2.0**19, growth_interval=25, backoff_factor=0.25, max_scale=math.inf
)

# Headroom: the policy's defaults (init_scale 2**15, one octave of margin, a held peak
# that falls an octave per 100 steps), uncapped like the dynamic scale. Its first good
# step jumps to the measured target (2**15-2**16 in mean, 2**24-2**25 in update_2^19),
# so init_scale matters for one step only: 2**19 would overflow the first step of every
# mean row (blind, nothing measured yet) and cost one skipped step each, the same as the
# dynamic scale's first step.
HEADROOM = lsj.HeadroomScale(max_scale=math.inf)

CONFIGS: tuple[Config, ...] = (
    Config("fp32", F32, lsj.NoScale()),
    Config("fp16", F16, lsj.NoScale()),
    Config("fp16_static", F16, lsj.StaticScale(STATIC_SCALE)),
    Config("fp16_dynamic", F16, DYNAMIC),
    Config("fp16_headroom", F16, HEADROOM, taps=True),
)


# --------------------------------------------------------------------------
# Data.


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The Language Reference text as character ids; 90/10 train/validation split."""

    chars: str
    train: np.ndarray
    val: np.ndarray

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        index = {c: i for i, c in enumerate(self.chars)}
        return np.array([index[c] for c in text], np.int32)

    def decode(self, ids: Any) -> str:
        return "".join(self.chars[i] for i in np.asarray(ids).tolist())


@functools.cache
def load_corpus() -> Corpus:
    """``pydoc_data.topics``, topics in sorted order, split 90/10 by position."""
    from pydoc_data import topics

    text = "".join(topics.topics[k] for k in sorted(topics.topics))
    chars = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(chars)}
    ids = np.fromiter((index[c] for c in text), np.int32, len(text))
    split = int(0.9 * len(ids))
    return Corpus(chars=chars, train=ids[:split], val=ids[split:])


def batch_offsets(seed: int, steps: int, n: int) -> np.ndarray:
    """(steps, BATCH) start offsets of the training windows, alike for every config."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, n - CONTEXT - 1, (steps, BATCH), dtype=np.int32)


def windows(tokens: jax.Array, offsets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inputs and next-character targets, each ``offsets.shape + (CONTEXT,)``."""
    w = tokens[offsets[..., None] + jnp.arange(CONTEXT + 1)]
    return w[..., :-1], w[..., 1:]


# --------------------------------------------------------------------------
# Model.

_INIT = nn.initializers.normal(0.02)  # GPT-2
_PROJ_INIT = nn.initializers.normal(
    0.02 / math.sqrt(2 * N_LAYER)
)  # residual projections


class Block(nn.Module):
    """Pre-LayerNorm transformer block; computes in the dtype of its parameters.

    Flax's LayerNorm computes its statistics in float32 whatever the input; the
    attention softmax is taken in float32 and cast back.
    """

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        hd = d // N_HEAD
        h = nn.LayerNorm(epsilon=1e-5)(x)
        qkv = nn.Dense(3 * d, kernel_init=_INIT)(h).reshape(b, t, 3, N_HEAD, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q * (hd**-0.5), k).astype(F32)
        causal = jnp.tril(jnp.ones((t, t), bool))
        att = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(
            x.dtype
        )
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
        x = x + nn.Dense(d, kernel_init=_PROJ_INIT)(y)
        h = nn.LayerNorm(epsilon=1e-5)(x)
        h = nn.gelu(nn.Dense(4 * d, kernel_init=_INIT)(h))
        return x + nn.Dense(d, kernel_init=_PROJ_INIT)(h)


class GPT(nn.Module):
    """Character-level GPT with tied input/output embeddings; float32 logits.

    All layers infer their compute dtype from the parameters: apply it to a
    float16 copy of the parameters to compute in float16.
    """

    vocab_size: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        wte = nn.Embed(self.vocab_size, D_MODEL, embedding_init=_INIT, name="wte")
        wpe = nn.Embed(CONTEXT, D_MODEL, embedding_init=_INIT, name="wpe")
        x = wte(tokens) + wpe(jnp.arange(tokens.shape[-1]))
        for _ in range(N_LAYER):
            x = Block()(x)
        x = nn.LayerNorm(epsilon=1e-5)(x)
        return wte.attend(x).astype(F32)


LossFn = Callable[[Any, tuple[jax.Array, jax.Array]], jax.Array]


@functools.cache
def loss_function(vocab_size: int) -> LossFn:
    """``loss_fn(params, batch)``: the mean next-character cross-entropy, in float32.

    It computes in the dtype of the parameters it is given (cast them to float16 for
    float16 compute); ``batch`` is ``(inputs, targets)``, int32 arrays of shape
    (batch, CONTEXT). One object per vocabulary size, so jitted functions that hold it
    as a static value compile once.
    """
    model = GPT(vocab_size)

    def loss_fn(params, batch):
        inputs, targets = batch
        logits = model.apply({"params": params}, inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return loss_fn


def build_model(vocab_size: int, seed: int | jax.Array = 0) -> tuple[Any, LossFn]:
    """The float32 master weights of seed ``seed`` and ``loss_function(vocab_size)``."""
    example = jnp.zeros((1, CONTEXT), jnp.int32)
    params = GPT(vocab_size).init(jax.random.key(seed), example)["params"]
    return params, loss_function(vocab_size)


def cast(tree: Any, dtype: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: a.astype(dtype), tree)


# --------------------------------------------------------------------------
# Training: one lsj.TrainState per row (a setting and a seed). A step is two jitted
# calls: the gradient (compiled once per compute dtype, shared by every configuration:
# the loss scale comes in as data) and the optimizer step (compiled once per
# configuration).


@functools.cache
def make_tx(config: Config, steps: int) -> optax.GradientTransformationExtraArgs:
    """AdamW, warm-up, cosine decay, inside ``loss_scaling`` with the config's policy.

    Cached: the same object for the same arguments, so the jitted step, whose train
    state holds ``tx`` as a static field, compiles once per configuration.
    """
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=LR,
        warmup_steps=min(WARMUP, steps),
        decay_steps=max(steps, WARMUP + 1),
        end_value=LR_END,
    )

    def decay_matrices(p):
        return jax.tree_util.tree_map(lambda a: a.ndim >= 2, p)

    inner = optax.adamw(schedule, b2=B2, weight_decay=WEIGHT_DECAY, mask=decay_matrices)
    return lsj.loss_scaling(inner, config.policy)


@functools.partial(jax.jit, static_argnums=0)
def init_params(vocab_size: int, seed: jax.Array) -> Any:
    """The float32 master weights of ``seed`` (one compilation for every seed)."""
    return build_model(vocab_size, seed)[0]


@functools.partial(jax.jit, static_argnums=(0, 1))
def gradients(loss_fn, dtype, params, tokens, offsets, weight, loss_scale):
    """``(grads, loss)``: the gradient of ``scale * weight * loss`` and the loss itself.

    The gradient is taken with respect to the ``dtype`` copy of the float32 master
    weights ``params`` (so it is float16 for float16 compute); ``loss_scale`` is the
    configuration's ``LossScaleState`` (``NoScale().init()`` for none).
    """
    batch = windows(tokens, offsets)

    def scaled_loss(p):
        loss = loss_fn(p, batch)
        return lsj.scale_loss(loss * weight, loss_scale), loss

    return jax.grad(scaled_loss, has_aux=True)(cast(params, dtype))


def tapped(module: nn.Module) -> bool:
    """The modules whose outputs are tapped: each block, and the model (the logits)."""
    return isinstance(module, Block | GPT)


@functools.partial(jax.jit, static_argnums=(0, 1))
def tapped_gradients(loss_fn, dtype, params, tokens, offsets, weight, loss_scale):
    """``(grads, loss, taps)``: ``gradients`` and the statistics of the activation
    gradients at every block's output and the logits (``lsj.taps``)."""
    batch = windows(tokens, offsets)

    def scaled_loss(p):
        loss = loss_fn(p, batch)
        return lsj.scale_loss(loss * weight, loss_scale), loss

    grad_fn = lsj.taps.value_and_grad(scaled_loss, has_aux=True, modules=tapped)
    (_, loss), grads, taps = grad_fn(cast(params, dtype))
    return grads, loss, taps


@jax.jit
def apply_gradients(state: lsj.TrainState, grads: Any, taps: Any = None):
    """One optimizer step: ``(state, the scale it used, whether it was skipped)``."""
    scale = lsj.get_loss_scale_state(state.opt_state).scale
    state = state.apply_gradients(grads=grads, taps=taps)
    return state, scale, lsj.get_loss_scale_state(state.opt_state).last_skipped


@jax.jit
def lost_entries(g16: Any, g32: Any) -> tuple[jax.Array, jax.Array]:
    """(#entries zero in ``g16`` but not in ``g32``, #entries non-zero in ``g32``)."""
    pairs = zip(
        jax.tree_util.tree_leaves(g16), jax.tree_util.tree_leaves(g32), strict=True
    )
    lost = sum(jnp.sum((a == 0) & (b != 0), dtype=jnp.int32) for a, b in pairs)
    nonzero = sum(
        jnp.sum(b != 0, dtype=jnp.int32) for b in jax.tree_util.tree_leaves(g32)
    )
    return lost, nonzero


@functools.partial(jax.jit, static_argnums=0)
def evaluate(loss_fn, params, val_inputs, val_targets):
    """Validation loss: float32 master weights, float32 compute."""
    return loss_fn(params, (val_inputs, val_targets))


@functools.partial(jax.jit, static_argnums=(3, 4))
def generate(params, prompt, key, length, vocab_size):
    """``length`` characters sampled after ``prompt`` at ``TEMPERATURE`` (float32)."""
    model = GPT(vocab_size)
    n = prompt.shape[0]
    buf = jnp.zeros((n + length,), jnp.int32).at[:n].set(prompt)

    def body(buf, xs):
        pos, k = xs  # predict the character at position pos from the CONTEXT before it
        start = jnp.maximum(pos - CONTEXT, 0)
        window = lax.dynamic_slice(buf, (start,), (CONTEXT,))
        logits = model.apply({"params": params}, window[None])[0, pos - 1 - start]
        return buf.at[pos].set(
            jax.random.categorical(k, logits / TEMPERATURE).astype(jnp.int32)
        ), None

    pos = jnp.arange(n, n + length)
    return lax.scan(body, buf, (pos, jax.random.split(key, length)))[0][n:]


# --------------------------------------------------------------------------
# The job.


def compile_in_parallel(lowered: Sequence[Any], workers: int = 2) -> None:
    """Compiles lowered jitted calls on ``workers`` threads (XLA: one core per call).

    A compiled call lands in its jitted function's cache, so the calls that follow run
    it.
    """
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda low: low.compile(), lowered))


def run(
    steps: int, seeds: int, probe_every: int, progress: bool = True
) -> dict[str, Any]:
    """Trains every configuration on every (setting, seed) row; returns the rows."""
    from tqdm.auto import tqdm

    corpus = load_corpus()
    vocab = corpus.vocab_size
    tokens = jnp.asarray(corpus.train)
    n_val = min(VAL_WINDOWS, (len(corpus.val) - 1) // CONTEXT)
    val_offsets = np.linspace(0, len(corpus.val) - CONTEXT - 1, n_val).astype(np.int32)
    val_inputs, val_targets = windows(jnp.asarray(corpus.val), jnp.asarray(val_offsets))
    prompt = jnp.asarray(corpus.encode(PROMPT))
    key = jax.random.key(0)
    unscaled = lsj.NoScale().init()

    rows = [(setting, seed) for setting in SETTINGS for seed in range(seeds)]
    weights = [jnp.float32(setting.loss_weight) for setting, _ in rows]
    params = {seed: init_params(vocab, jnp.int32(seed)) for seed in range(seeds)}
    offsets = {
        seed: batch_offsets(seed, steps, len(corpus.train)) for seed in range(seeds)
    }
    loss_fn = loss_function(vocab)

    def stats_shape(config):  # the taps' shapes, for compiling ahead of the first step
        if not config.taps:
            return ()
        return (
            jax.eval_shape(
                functools.partial(tapped_gradients, loss_fn, config.dtype),
                *(p0, tokens, offs0, w0, unscaled),
            )[2],
        )

    def new_state(config, seed):
        tx = make_tx(config, steps)
        return lsj.TrainState.create(apply_fn=loss_fn, params=params[seed], tx=tx)

    # Compile every step function before the first step, two at a time.
    p0, offs0, w0 = params[0], offsets[0][0], weights[0]
    dtypes = list(dict.fromkeys(c.dtype for c in CONFIGS))
    compile_in_parallel(
        [gradients.lower(loss_fn, F32, p0, tokens, offs0, w0, unscaled)]
        + [
            gradients.lower(loss_fn, d, p0, tokens, offs0, w0, unscaled)
            for d in dtypes
            if d != F32
        ]
        + [
            tapped_gradients.lower(loss_fn, c.dtype, p0, tokens, offs0, w0, unscaled)
            for c in CONFIGS
            if c.taps
        ]
        + [
            apply_gradients.lower(new_state(c, 0), cast(p0, c.dtype), *stats_shape(c))
            for c in CONFIGS
        ]
        + [lost_entries.lower(cast(p0, d), p0) for d in dtypes if d != F32]
        + [
            evaluate.lower(loss_fn, p0, val_inputs, val_targets),
            generate.lower(p0, prompt, key, SAMPLE_LENGTH, vocab),
        ]
    )

    bar = tqdm(
        total=len(CONFIGS) * len(rows) * steps,
        unit="step",
        disable=not progress,
        dynamic_ncols=True,
        mininterval=0.5,
    )
    results: dict[str, dict[str, Any]] = {}
    for config in CONFIGS:
        bar.set_description(config.name)
        states = [new_state(config, seed) for _, seed in rows]
        hist: list[dict[str, list]] = [
            {k: [] for k in ("loss", "scale", "skipped", "lost", "nonzero")}
            for _ in rows
        ]
        for t in range(steps):
            for i, (_, seed) in enumerate(rows):
                state, h = states[i], hist[i]
                loss_scale = lsj.get_loss_scale_state(state.opt_state)
                args = (state.params, tokens, offsets[seed][t], weights[i])
                if config.taps:
                    grads, loss, taps = tapped_gradients(
                        loss_fn, config.dtype, *args, loss_scale
                    )
                else:
                    (grads, loss), taps = (
                        gradients(loss_fn, config.dtype, *args, loss_scale),
                        None,
                    )
                if t % probe_every == 0 and config.dtype != F32:
                    reference, _ = gradients(loss_fn, F32, *args, unscaled)
                    lost, nonzero = lost_entries(grads, reference)
                    h["lost"].append(lost)
                    h["nonzero"].append(nonzero)
                states[i], scale, skipped = apply_gradients(state, grads, taps)
                h["loss"].append(loss)
                h["scale"].append(scale)
                h["skipped"].append(skipped)
            if (t + 1) % probe_every == 0 or t + 1 == steps:
                jax.block_until_ready(states)
                bar.update(len(rows) * ((t % probe_every) + 1))
        results[config.name] = dict(
            history=[
                {k: np.asarray(jax.device_get(v)) for k, v in h.items()} for h in hist
            ],
            metrics=[jax.device_get(lsj.metrics(s.opt_state)) for s in states],
            step=[int(s.step) for s in states],
            val_loss=[
                float(evaluate(loss_fn, s.params, val_inputs, val_targets))
                for s in states
            ],
            samples=[  # seed 0 of each setting
                PROMPT
                + corpus.decode(generate(s.params, prompt, key, SAMPLE_LENGTH, vocab))
                if seed == 0
                else None
                for s, (_, seed) in zip(states, rows, strict=True)
            ],
        )
    bar.close()
    return dict(rows=rows, results=results, corpus=corpus, steps=steps)


def diagnose_model(quick: bool = False) -> lsj.Diagnosis:
    """``lsj.diagnose`` of the model in the ``update_2^19`` setting, before training.

    Seed 0's initial float32 weights, the first micro-batches seed 0 trains on, float16
    compute as in the training step (the weights cast to float16, the loss weight
    applied to the float32 loss); the float32 reference is the same program in float32.
    The blocks and the model are tapped, so it also localizes (per block: where the
    underflow starts); ``quick`` leaves the localizer's three passes out.
    """
    corpus = load_corpus()
    tokens = jnp.asarray(corpus.train)
    setting = next(s for s in SETTINGS if s.name == "update_2^19")
    model_loss = loss_function(corpus.vocab_size)

    def loss_fn(params, batch):
        return model_loss(cast(params, F16), batch) * setting.loss_weight

    n = 1 if quick else DIAGNOSIS_BATCHES
    offsets = batch_offsets(0, n, len(corpus.train))  # the first n steps of seed 0
    batches = [windows(tokens, jnp.asarray(o)) for o in offsets]
    params = init_params(corpus.vocab_size, jnp.int32(0))
    scales = DIAGNOSIS_SCALES[::2] if quick else DIAGNOSIS_SCALES
    return lsj.diagnose(
        loss_fn,
        params,
        batches,
        scale=DYNAMIC.init_scale,
        scales=scales,
        print_table=False,
        modules=tapped,
        localize=not quick,  # --quick: the per-leaf rows only
    )


def result_rows(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON rows: one per (setting, configuration, seed)."""
    out = []
    for config in CONFIGS:
        r = job["results"][config.name]
        for i, (setting, seed) in enumerate(job["rows"]):
            h, m = r["history"][i], r["metrics"][i]
            lost, nonzero = int(np.sum(h["lost"])), int(np.sum(h["nonzero"]))
            out.append(
                dict(
                    setting=setting.name,
                    config=config.name,
                    seed=seed,
                    train_loss=float(h["loss"][-TRAIN_LOSS_LAST:].mean()),
                    val_loss=r["val_loss"][i],
                    lost_fraction=None
                    if config.dtype == F32
                    else lost / max(nonzero, 1),
                    skipped_fraction=int(m["skipped_steps"]) / int(m["total_steps"]),
                    final_scale=float(m["loss_scale"]),
                )
            )
    return out


def _mean_std(values: Sequence[float], fmt: str = ".3f", sign: str = "") -> str:
    v = np.asarray(values, np.float64)
    std = v.std(ddof=1) if len(v) > 1 else 0.0
    mean = f"{v.mean():{sign}{fmt}}"
    if float(mean) == 0.0:  # no "-0.000"
        mean = f"{0.0:{sign}{fmt}}"
    return f"{mean} ± {std:{fmt}}"


def _scales(values: Sequence[float]) -> str:
    """Final scales as powers of two where they are (``2^10``, ``2^26-2^28``)."""
    values = sorted(set(values))
    if all(v > 0 and 2.0 ** round(math.log2(v)) == v for v in values):
        exps = [round(math.log2(v)) for v in values]
        return f"2^{exps[0]}" if len(exps) == 1 else f"2^{exps[0]}-2^{exps[-1]}"
    return ", ".join(f"{v:g}" for v in values)


def format_table(
    rows: list[dict[str, Any]], steps: int, seeds: int, probe_every: int
) -> str:
    """Mean ± std over seeds per (setting, configuration), then what the names mean."""
    lines = [
        f"| setting | config | train loss (last {TRAIN_LOSS_LAST} steps) | val loss | "
        "val loss - fp32 (same seed) | val perplexity | entries lost to underflow "
        "(min-max over seeds) | skipped steps (guideline < 0.5%) | final scale |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for setting in SETTINGS:
        mine = [r for r in rows if r["setting"] == setting.name]
        ref = {r["seed"]: r["val_loss"] for r in mine if r["config"] == CONFIGS[0].name}
        for config in CONFIGS:
            rs = [r for r in mine if r["config"] == config.name]
            val = [r["val_loss"] for r in rs]
            delta = [r["val_loss"] - ref[r["seed"]] for r in rs]
            if config.dtype == F32:
                lost = "reference"
            else:
                pct = [100 * r["lost_fraction"] for r in rs]
                lost = f"{np.mean(pct):.3g}% ({min(pct):.3g}-{max(pct):.3g})"
            skipped = sum(round(r["skipped_fraction"] * steps) for r in rs)
            rate = skipped / (steps * len(rs))
            flag = "ok" if rate < GUIDELINE else "over"
            lines.append(
                f"| {setting.name} | {config.name} "
                f"| {_mean_std([r['train_loss'] for r in rs])} | {_mean_std(val)} "
                f"| {_mean_std(delta, sign='+')} | {_mean_std(np.exp(val), '.2f')} "
                f"| {lost} "
                f"| {100 * rate:.2f}% ({skipped} of {steps * len(rs)}, {flag}) "
                f"| {_scales([r['final_scale'] for r in rs])} |"
            )
    plural = "s" if seeds != 1 else ""
    lines += [
        "",
        f"{steps} steps of AdamW (lr {LR:g}, {WARMUP} warm-up steps, "
        f"cosine to {LR_END:g}), {TOKENS:,} tokens per step, {seeds} seed{plural}: "
        "mean ± std over seeds. Val loss: float32 weights in float32 on "
        f"{VAL_WINDOWS * CONTEXT:,} validation tokens. Entries lost: non-zero in a "
        "float32 gradient, zero in the config's float16 one (same weights and batch), "
        f"counted every {probe_every} steps.",
        "",
    ]
    lines += [f"- {s.name}: {s.description}" for s in SETTINGS]
    lines += [
        f"- {c.name}: {jnp.dtype(c.dtype).name} compute, {c.policy}" for c in CONFIGS
    ]
    return "\n".join(lines)


def _smooth(x: np.ndarray, k: int = 10) -> np.ndarray:
    k = max(1, min(k, len(x)))
    c = np.cumsum(np.insert(np.asarray(x, np.float64), 0, 0.0))
    head = c[1:k] / np.arange(1, k)  # growing window over the first k - 1 steps
    return np.concatenate([head, (c[k:] - c[:-k]) / k])


def plot(job: dict[str, Any], path: pathlib.Path) -> None:
    """One column per float16 configuration: the loss in each setting (float32's seeds
    in grey behind), then the loss scale of every row with its skipped steps marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, rows = job["results"], job["rows"]
    ref_name = CONFIGS[0].name
    columns = [c for c in CONFIGS if c.dtype != F32]
    from matplotlib.lines import Line2D

    # Fonts sized for a figure shown about 750 pixels wide (a documentation page); one
    # legend, below the panels, never over the curves.
    with plt.rc_context({"font.size": 12, "axes.titlesize": 12, "legend.fontsize": 11}):
        fig, axes = plt.subplots(
            len(SETTINGS) + 1,
            len(columns),
            figsize=(3.4 * len(columns), 3.0 * (len(SETTINGS) + 1) + 1.2),
            sharex=True,
            squeeze=False,
            layout="constrained",
        )
        for ax in axes[-1, 1:]:  # one scale axis for the whole bottom row
            ax.sharey(axes[-1, 0])
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for col, config in enumerate(columns):
            hist, ref = results[config.name]["history"], results[ref_name]["history"]
            for r, setting in enumerate(SETTINGS):
                ax = axes[r, col]
                mine = [i for i, (s, _) in enumerate(rows) if s == setting]
                for j, i in enumerate(mine):
                    ax.plot(
                        _smooth(ref[i]["loss"]),
                        color="0.65",
                        lw=2.5,
                        label=f"{ref_name}" if j == 0 else None,
                    )
                for j, i in enumerate(mine):
                    ax.plot(
                        _smooth(hist[i]["loss"]),
                        color=colors[j % len(colors)],
                        lw=1,
                        label=f"seed {rows[i][1]}",
                    )
                ax.set_title(f"{config.name}\n{setting.name}")
                ax.set_ylim(2.0, 4.8)
                ax.grid(alpha=0.3)
                if col == 0:
                    ax.set_ylabel(f"{setting.name}:\ntrain loss (10-step mean)")
            ax = axes[-1, col]
            for i, (setting, seed) in enumerate(rows):
                style = "-" if setting is SETTINGS[-1] else ":"
                color = colors[seed % len(colors)]
                ax.plot(
                    hist[i]["scale"],
                    style,
                    color=color,
                    lw=1.5,
                    label=f"{setting.name}, seed {seed}",
                )
                skipped = np.flatnonzero(hist[i]["skipped"])
                ax.plot(
                    skipped, hist[i]["scale"][skipped], "x", color=color, ms=7, mew=2
                )
            ax.set_yscale("log", base=2)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel("loss scale")
        # One legend for every panel: a seed has one colour throughout.
        key = [
            Line2D([], [], color="0.65", lw=2.5, label=f"{ref_name}, every seed"),
            *(
                Line2D([], [], color=colors[k % len(colors)], label=f"seed {k}")
                for k in sorted({seed for _, seed in rows})
            ),
            Line2D([], [], color="k", ls=":", label=f"scale, {SETTINGS[0].name}"),
            Line2D([], [], color="k", label=f"scale, {SETTINGS[-1].name}"),
            Line2D([], [], color="k", ls="", marker="x", mew=2, label="skipped step"),
        ]
        fig.legend(handles=key, loc="outside lower center", ncols=4)
        fig.suptitle(
            f"char-level GPT on the Python Language Reference, {job['steps']} steps:\n"
            "float16 vs float32 (grey), with and without loss scaling"
        )
        fig.savefig(path, dpi=90)
    plt.close(fig)


def format_samples(job: dict[str, Any]) -> str:
    """Seed 0's generated text for every setting and configuration."""
    parts = []
    for setting in SETTINGS:
        i = next(
            i for i, (s, seed) in enumerate(job["rows"]) if s == setting and seed == 0
        )
        for config in CONFIGS:
            text = job["results"][config.name]["samples"][i]
            parts.append(f"--- {setting.name}, {config.name} (seed 0) ---\n{text}\n")
    return "\n".join(parts)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--steps", type=int, default=None, help=f"optimizer steps (default {STEPS})"
    )
    p.add_argument("--seeds", type=int, default=None, help="seeds (default 3)")
    p.add_argument(
        "--probe-every",
        type=int,
        default=25,
        help="count the entries lost to underflow every N steps (default 25)",
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
        help="a short run for the test suite (25 steps, 2 seeds)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 25 if args.quick else STEPS
    if args.seeds is None:
        args.seeds = 2 if args.quick else 3
    for name in ("steps", "seeds", "probe_every"):
        if getattr(args, name) < 1:
            p.error(
                f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
            )
    if args.steps < TRAIN_LOSS_LAST:
        p.error(
            f"--steps must be >= {TRAIN_LOSS_LAST} (the train loss averages the last "
            f"{TRAIN_LOSS_LAST} steps), got {args.steps}"
        )
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t0, c0 = time.perf_counter(), time.process_time()
    args.out.mkdir(parents=True, exist_ok=True)
    diagnosis = diagnose_model(args.quick)
    print(
        "What float16 does to this model's gradients in the update_2^19 setting, "
        "before training (lsj.diagnose):\n"
    )
    print(diagnosis.table() + "\n", flush=True)
    (args.out / "gpt_diagnosis.txt").write_text(diagnosis.table() + "\n")
    diagnosis.plot(args.out / "gpt_diagnosis.png")
    job = run(args.steps, args.seeds, args.probe_every, progress=not args.no_progress)
    rows = result_rows(job)
    table = format_table(rows, args.steps, args.seeds, args.probe_every)
    samples = format_samples(job)

    (args.out / "gpt_results.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "gpt_table.md").write_text(table + "\n")
    (args.out / "gpt_samples.txt").write_text(samples)
    plot(job, args.out / "gpt_plot.png")
    print(table)
    print(f"\nGenerated text (seed 0, temperature {TEMPERATURE}, after {PROMPT!r}):\n")
    print(samples)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(
        f"wrote {args.out / 'gpt_results.json'}, gpt_table.md, gpt_plot.png, "
        f"gpt_samples.txt, gpt_diagnosis.txt and gpt_diagnosis.png in {wall:.0f} s "
        f"({cpu:.0f} s of CPU time)"
    )
    return dict(
        job=job,
        rows=rows,
        table=table,
        diagnosis=diagnosis,
        out=args.out,
        wall_s=wall,
        cpu_s=cpu,
    )


if __name__ == "__main__":
    main()
