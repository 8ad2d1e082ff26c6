# pyright: reportMissingImports=false
# (Tunix is an optional dependency: the type check runs without it installed.)
"""The train step ``enable`` gives a trainer of Tunix's main branch (a gradient accumulator
of Tunix's own; :data:`_seams.MAIN_COMMIT` tested).

There the step is ``_train_step(model, optimizer, grad_accumulator, inputs, is_update_step)``
(``nnx.jit`` donates the optimizer and the accumulator). Without accumulation it updates
from the micro-batch's gradients; with it, it adds them to the accumulator and updates under
``nnx.cond(is_update_step, ...)`` from the accumulator's ``sum / denominator``. A loss may
return a ``LossOutput``: its loss is a sum over tokens, and Tunix divides the gradients by the
token count after the backward pass, which in float16 overflows for any loss scale of 1 or
more once the sum runs over thousands of tokens.

The step here keeps that structure, loss-scaled:

- the loss differentiated is the normalised one, ``unreduced_sum / denominator`` (Tunix's
  ``WeightedMetric.compute``), times the scale (``lsj.value_and_grad``): the gradients are
  the mean's, scaled, never the sum's;
- without accumulation, ``optimizer.update`` unscales, checks and skips, as on 0.1.7;
- with it, the accumulator gets the scaled gradients in float32 times the micro-batch's
  denominator (the scaled gradient of the sum: Tunix's ``sum / denominator`` over the window
  is then its mean, weighted as Tunix weights it), and the update step hands
  ``optimizer.update`` the window's ``sum / denominator``, still scaled, in float32. The
  scale moves only at an update (one decision per window), so every micro-batch of a window
  has the same one; a micro-batch that overflowed leaves inf or nan in the sum, and the
  whole window is skipped, its scale backed off once. The accumulator is emptied either way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.interpreters import pxla
from tunix.sft import utils as tunix_utils

from lossscale_jax.engine._ops import where
from lossscale_jax.gradients import unscaled_global_norm, value_and_grad
from lossscale_jax.integrations._host import _metrics
from lossscale_jax.integrations.tunix._step import outputs


def depth_one(trainer: Any) -> bool:
    """Whether Tunix's step updates from each micro-batch directly (no accumulator)."""
    config = trainer.config
    return (
        config.get_with_default("gradient_accumulation_steps", 1) == 1
        and getattr(config, "max_seq_token_per_tpu", None) is None
    )


def make_train_step(trainer: Any) -> Callable[..., tuple[Any, Any, Any]]:
    """The loss-scaled ``(model, optimizer, grad_accumulator, inputs, is_update_step) ->
    (loss, aux, grad_norm)`` of ``trainer``."""
    leaves = _metrics.Leaves()

    def train_step(
        model: Any, optimizer: Any, grad_accumulator: Any, inputs: Any, is_update_step: Any
    ) -> tuple[Any, Any, Any]:
        inputs = trainer.gen_model_input_fn(inputs)
        loss_fn, has_aux = trainer.loss_fn, trainer._has_aux  # read when traced, as Tunix

        @functools.wraps(loss_fn)  # its signature: nnx binds the inputs to it by name
        def diff_fn(model: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            out = loss_fn(model, *args, **kwargs)
            if isinstance(out, tunix_utils.LossOutput):
                return out.primary_loss.compute(), out  # the mean, before the backward pass
            return out if has_aux else (out, None)

        argnums = nnx.DiffState(0, nnx.LoRAParam) if trainer._lora_enabled else 0
        grad_fn = value_and_grad(diff_fn, optimizer, argnums=argnums, has_aux=True)
        scale = _metrics.scale_used(nnx.as_pure(optimizer.opt_state))  # before the update
        (loss, aux), grads = grad_fn(model, **inputs)
        leaves.note(nnx.as_pure(grads))
        if depth_one(trainer):
            grad_norm = unscaled_global_norm(grads, optimizer)
            optimizer.update(model, grads)
        else:
            weighted = isinstance(aux, tunix_utils.LossOutput)
            denom = aux.primary_loss.denominator if weighted else jnp.float32(1.0)
            denom = jnp.asarray(denom, jnp.float32)
            grad_accumulator.add(
                jax.tree_util.tree_map(lambda g: g.astype(jnp.float32) * denom, grads),
                denom=denom,
            )
            if not pxla.thread_resources.env.physical_mesh.empty:  # one decision everywhere
                is_update_step = jax.lax.with_sharding_constraint(
                    is_update_step, jax.sharding.PartitionSpec()
                )
            grad_norm = nnx.cond(is_update_step, _apply, _wait, model, optimizer, grad_accumulator)
        return outputs(loss, aux, grad_norm, optimizer, scale)

    trainer._lossscale_jax_leaves = leaves
    return train_step


def _apply(model: Any, optimizer: Any, grad_accumulator: Any) -> jax.Array:
    """The window's update: its scaled ``sum / denominator`` (float32) to the optimizer,
    which unscales, checks and applies or skips; the accumulator emptied."""
    denom = grad_accumulator.denom[...]
    inverse = where(denom == 0, 0.0, 1.0 / where(denom == 0, 1.0, denom))
    grads = jax.tree_util.tree_map(
        lambda v: type(v)(v[...] * inverse),
        grad_accumulator.grads,
        is_leaf=lambda v: isinstance(v, nnx.Variable),
    )
    norm = unscaled_global_norm(grads, optimizer)
    optimizer.update(model, grads)
    grad_accumulator.reset()
    return norm.astype(jnp.float32)


def _wait(model: Any, optimizer: Any, grad_accumulator: Any) -> jax.Array:
    """A micro-batch inside the window: nothing applied (Tunix logs a norm of 0)."""
    del model, optimizer, grad_accumulator
    return jnp.zeros((), jnp.float32)
