"""Flax's ImageNet and WMT train steps, re-expressed with their logic unchanged.

Upstream: ``examples/imagenet/train.py`` (``train_step``, ``create_train_state``,
``create_learning_rate_fn``, ``cross_entropy_loss``, ``compute_metrics``, the ``pmap`` with
``in_axes=(None, 0), out_axes=(None, 0)``) and ``examples/wmt/train.py`` (``train_step``,
``compute_weighted_cross_entropy``, the replicated state and ``pmap``). Only the models are
tiny (a one-block ResNet v1.5 on 8x8 images, a one-layer encoder-decoder) and the data is
random. ``dynamic_scale_lib`` is a parameter: Flax's ``flax.training.dynamic_scale`` or
``lossscale_jax.compat.flax``, the one line a user changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import jax_utils
from flax import linen as nn
from flax.training import common_utils, train_state
from jax import lax

NUM_CLASSES = 5
IMAGE = 8
VOCAB = 11
AXIS = "batch"


# --------------------------------------------------------------------------
# ImageNet: examples/imagenet/models.py (ResNet v1.5, one block) and train.py.


class ResNetBlock(nn.Module):
    filters: int
    conv: Any
    norm: Any
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = self.norm()(y)
        y = self.act(y)
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
            residual = self.norm(name="norm_proj")(residual)
        return self.act(residual + y)


class ResNet(nn.Module):
    stage_sizes: Sequence[int]
    num_classes: int
    num_filters: int = 4
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
            axis_name="batch",
        )
        x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
        x = norm(name="bn_init")(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = ResNetBlock(
                    self.num_filters * 2**i, strides=strides, conv=conv, norm=norm, act=nn.relu
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
        return jnp.asarray(x, self.dtype)


def cross_entropy_loss(logits, labels):
    one_hot_labels = common_utils.onehot(labels, num_classes=NUM_CLASSES)
    xentropy = optax.softmax_cross_entropy(logits=logits, labels=one_hot_labels)
    return jnp.mean(xentropy)


def compute_metrics(logits, labels):
    loss = cross_entropy_loss(logits, labels)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return lax.pmean({"loss": loss, "accuracy": accuracy}, axis_name="batch")


def create_learning_rate_fn(base_learning_rate, steps_per_epoch, warmup_epochs=1, num_epochs=4):
    warmup_fn = optax.linear_schedule(
        init_value=0.0,
        end_value=base_learning_rate,
        transition_steps=warmup_epochs * steps_per_epoch,
    )
    cosine_epochs = max(num_epochs - warmup_epochs, 1)
    cosine_fn = optax.cosine_decay_schedule(
        init_value=base_learning_rate, decay_steps=cosine_epochs * steps_per_epoch
    )
    return optax.join_schedules(
        schedules=[warmup_fn, cosine_fn], boundaries=[warmup_epochs * steps_per_epoch]
    )


def imagenet_train_step(state, batch, learning_rate_fn):
    def loss_fn(params):
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["image"],
            mutable=["batch_stats"],
        )
        loss = cross_entropy_loss(logits, batch["label"])
        weight_penalty_params = jax.tree_util.tree_leaves(params)
        weight_decay = 0.0001
        weight_l2 = sum(jnp.sum(x**2) for x in weight_penalty_params if x.ndim > 1)
        weight_penalty = weight_decay * 0.5 * weight_l2
        loss = loss + weight_penalty
        return loss, (new_model_state, logits)

    step = state.step
    dynamic_scale = state.dynamic_scale
    lr = learning_rate_fn(step)

    if dynamic_scale:
        grad_fn = dynamic_scale.value_and_grad(loss_fn, has_aux=True, axis_name="batch")
        dynamic_scale, is_fin, aux, grads = grad_fn(state.params)
    else:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        aux, grads = grad_fn(state.params)
        grads = lax.pmean(grads, axis_name="batch")
    new_model_state, logits = aux[1]
    metrics = compute_metrics(logits, batch["label"])
    metrics["learning_rate"] = lr

    new_state = state.apply_gradients(
        grads=grads, batch_stats=lax.pmean(new_model_state["batch_stats"], "batch")
    )
    if dynamic_scale:
        new_state = new_state.replace(
            opt_state=jax.tree_util.tree_map(
                functools.partial(jnp.where, is_fin), new_state.opt_state, state.opt_state
            ),
            params=jax.tree_util.tree_map(
                functools.partial(jnp.where, is_fin), new_state.params, state.params
            ),
            dynamic_scale=dynamic_scale,
        )
        metrics["scale"] = dynamic_scale.scale
    return new_state, metrics


def imagenet_eval_step(state, batch):
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    logits = state.apply_fn(variables, batch["image"], train=False, mutable=False)
    return compute_metrics(logits, batch["label"])


class ImageNetTrainState(train_state.TrainState):
    batch_stats: Any
    dynamic_scale: Any


def imagenet_model():
    return ResNet(stage_sizes=[1], num_classes=NUM_CLASSES, dtype=jnp.float16)


def imagenet_initialized(model):
    variables = jax.jit(model.init)(
        {"params": jax.random.key(0)}, jnp.ones((1, IMAGE, IMAGE, 3), model.dtype)
    )
    return variables["params"], variables["batch_stats"]


def imagenet_create_train_state(dynamic_scale_lib, model, learning_rate_fn):
    """``create_train_state`` for half precision on a GPU (the branch that builds the scale)."""
    dynamic_scale = dynamic_scale_lib.DynamicScale()
    params, batch_stats = imagenet_initialized(model)
    tx = optax.sgd(learning_rate=learning_rate_fn, momentum=0.9, nesterov=True)
    return ImageNetTrainState.create(
        apply_fn=model.apply,
        params=params,
        tx=tx,
        batch_stats=batch_stats,
        dynamic_scale=dynamic_scale,
    )


def imagenet_p_train_step(learning_rate_fn):
    return jax.pmap(
        functools.partial(imagenet_train_step, learning_rate_fn=learning_rate_fn),
        in_axes=(None, 0),
        out_axes=(None, 0),
        axis_name="batch",
    )


def imagenet_batches(steps: int, devices: int, per_device: int, overflow: dict[int, float]):
    """Random float16 images and labels; ``overflow[step] = v`` writes ``v`` into one pixel
    of the first device's batch (``inf`` or a large finite value)."""
    rng = np.random.default_rng(0)
    out = []
    for step in range(steps):
        image = rng.normal(size=(devices, per_device, IMAGE, IMAGE, 3)).astype(np.float16)
        if step in overflow:
            image[0, 0, 0, 0, 0] = overflow[step]
        label = rng.integers(0, NUM_CLASSES, size=(devices, per_device)).astype(np.int32)
        out.append({"image": image, "label": label})
    return out


# --------------------------------------------------------------------------
# WMT: examples/wmt/train.py, with a one-layer encoder-decoder (float16 compute).


class TinyTransformer(nn.Module):
    dtype: Any = jnp.float16

    @nn.compact
    def __call__(self, inputs, targets, deterministic: bool = False):
        embed = nn.Embed(VOCAB, 8, name="shared_embedding")
        enc = nn.LayerNorm(dtype=self.dtype)(embed(inputs).astype(self.dtype))
        enc = nn.Dense(8, dtype=self.dtype)(enc)
        dec = embed(targets).astype(self.dtype) + jnp.mean(enc, axis=1, keepdims=True)
        dec = nn.LayerNorm(dtype=self.dtype)(dec)
        dec = nn.Dropout(rate=0.1)(nn.relu(nn.Dense(16, dtype=self.dtype)(dec)), deterministic)
        return nn.Dense(VOCAB, dtype=self.dtype)(dec)


def compute_weighted_cross_entropy(logits, targets, weights=None, label_smoothing=0.0):
    vocab_size = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low_confidence = (1.0 - confidence) / (vocab_size - 1)
    normalizing_constant = -(
        confidence * jnp.log(confidence)
        + (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20)
    )
    soft_targets = common_utils.onehot(
        targets, vocab_size, on_value=confidence, off_value=low_confidence
    )
    loss = -jnp.sum(soft_targets * nn.log_softmax(logits), axis=-1)
    loss = loss - normalizing_constant
    normalizing_factor = np.prod(targets.shape)
    if weights is not None:
        loss = loss * weights
        normalizing_factor = weights.sum()
    return loss.sum(), normalizing_factor


def wmt_compute_metrics(logits, labels, weights, label_smoothing=0.0):
    loss, weight_sum = compute_weighted_cross_entropy(logits, labels, weights, label_smoothing)
    acc = jnp.equal(jnp.argmax(logits, axis=-1), labels) * weights
    metrics = {"loss": loss, "accuracy": acc.sum(), "denominator": weight_sum}
    return jax.lax.psum(metrics, axis_name="batch")


def wmt_train_step(state, batch, learning_rate_fn, label_smoothing=0.1, dropout_rng=None):
    inputs, targets = batch["inputs"], batch["targets"]
    weights = jnp.where(targets > 0, 1, 0).astype(jnp.float32)
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        logits = TinyTransformer().apply(
            {"params": params}, inputs, targets, rngs={"dropout": dropout_rng}
        )
        loss, weight_sum = compute_weighted_cross_entropy(logits, targets, weights, label_smoothing)
        mean_loss = loss / weight_sum
        return mean_loss, logits

    step = state.step
    if state.dynamic_scale:
        grad_fn = state.dynamic_scale.value_and_grad(loss_fn, has_aux=True, axis_name="batch")
        dynamic_scale, is_fin, (_, logits), grads = grad_fn(state.params)
        state = state.replace(dynamic_scale=dynamic_scale)
    else:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, logits), grads = grad_fn(state.params)
        grads = jax.lax.pmean(grads, axis_name="batch")

    new_state = state.apply_gradients(grads=grads)
    metrics = wmt_compute_metrics(logits, targets, weights)
    metrics["learning_rate"] = learning_rate_fn(step)
    if state.dynamic_scale:
        select_fn = functools.partial(jnp.where, is_fin)
        new_state = new_state.replace(
            opt_state=jax.tree_util.tree_map(select_fn, new_state.opt_state, state.opt_state),
            params=jax.tree_util.tree_map(select_fn, new_state.params, state.params),
        )
        metrics["loss_scale"] = dynamic_scale.scale * metrics["denominator"]
    return new_state, metrics


class WmtTrainState(train_state.TrainState):
    dynamic_scale: Any


def wmt_learning_rate_fn(learning_rate=0.0625, warmup_steps=4):
    def rsqrt(count):
        return learning_rate * (count + warmup_steps) ** -0.5 * warmup_steps**0.5

    return optax.join_schedules(
        [
            optax.linear_schedule(
                init_value=0, end_value=learning_rate, transition_steps=warmup_steps
            ),
            rsqrt,
        ],
        boundaries=[warmup_steps],
    )


def wmt_setup(dynamic_scale_lib, learning_rate_fn):
    """The replicated state and the ``pmap``ped step (``train_and_evaluate``'s setup)."""
    model = TinyTransformer()
    shape = (1, 6)
    init = jax.jit(functools.partial(model.init, deterministic=True))
    params = init(jax.random.key(0), jnp.ones(shape, jnp.int32), jnp.ones(shape, jnp.int32))[
        "params"
    ]
    # The token VOCAB - 1 (only in the batches that inject an overflow) embeds to 1e5, which
    # float16 cannot hold: its forward pass overflows.
    emb = params["shared_embedding"]["embedding"]
    params["shared_embedding"]["embedding"] = emb.at[VOCAB - 1].set(1e5)
    optimizer = optax.adamw(learning_rate_fn, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0)
    state = WmtTrainState.create(
        apply_fn=model.apply,
        params=params,
        tx=optimizer,
        dynamic_scale=dynamic_scale_lib.DynamicScale(),
    )
    state = jax_utils.replicate(state)
    p_train_step = jax.pmap(
        functools.partial(wmt_train_step, learning_rate_fn=learning_rate_fn),
        axis_name="batch",
        donate_argnums=(0,),
    )
    return state, p_train_step


def wmt_batches(steps: int, devices: int, per_device: int, overflow: Sequence[int]):
    """Random token batches (0 is padding); at the steps in ``overflow`` one device's
    sequence carries the token whose embedding float16 cannot hold."""
    rng = np.random.default_rng(1)
    out = []
    for step in range(steps):
        inputs = rng.integers(0, VOCAB - 1, size=(devices, per_device, 6)).astype(np.int32)
        targets = rng.integers(0, VOCAB - 1, size=(devices, per_device, 6)).astype(np.int32)
        if step in overflow:
            inputs[0, 0, 0] = VOCAB - 1
            targets[0, 0, 0] = VOCAB - 1
        out.append({"inputs": inputs, "targets": targets})
    return out
