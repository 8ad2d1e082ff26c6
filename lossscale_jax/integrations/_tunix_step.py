"""The train step ``enable`` gives a Tunix trainer, and the metrics it logs.

Tunix's ``PeftTrainer._train_step(model, optimizer, inputs)`` takes ``grad(loss_fn)`` and
calls ``optimizer.update``: no place for the loss scale. The step here keeps its signature and
its return, ``(loss, aux, grad_norm)`` (``jit_train_and_eval_step`` jits it with
``donate_argnames=("optimizer",)``), and takes the gradients with ``lsj.value_and_grad`` of
whatever loss the trainer holds when it is traced (a learner's, set later with
``with_loss_fn``, included). It logs the unscaled gradient norm as Tunix's ``grad_norm``, and
the loss scale's metrics beside the trainer's own (``<prefix>/train/loss_scale/...``, through
the trainer's buffer: no host sync).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from flax import nnx

from lossscale_jax.access._metrics import metrics
from lossscale_jax.gradients import unscaled_global_norm, value_and_grad


# lsj.metrics key -> how the values of one optimizer step's micro-batches are reduced: the
# last (after the window's decision), as the trainer logs it once per optimizer step.
def _last(values: list[Any]) -> Any:
    return values[-1]


METRICS: dict[str, Callable[[list[Any]], Any]] = dict.fromkeys(
    ("loss_scale", "skipped", "skipped_steps", "overflow_rate"), _last
)
PREFIX = "loss_scale/"
LOG = logging.getLogger("lossscale_jax.integrations.tunix")
_OWN = "lossscale_jax"  # the key of the step's own outputs in what it returns as aux


def make_train_step(trainer: Any) -> Callable[..., tuple[Any, Any, Any]]:
    """The loss-scaled ``(model, optimizer, inputs) -> (loss, aux, grad_norm)`` of ``trainer``."""

    def train_step(model: Any, optimizer: Any, inputs: Any) -> tuple[Any, Any, Any]:
        inputs = trainer.gen_model_input_fn(inputs)
        has_aux = trainer._has_aux  # read when traced, as Tunix's own step reads them
        argnums = nnx.DiffState(0, nnx.LoRAParam) if trainer._lora_enabled else 0
        grad_fn = value_and_grad(trainer.loss_fn, optimizer, argnums=argnums, has_aux=has_aux)
        value, grads = grad_fn(model, **inputs)
        grad_norm = unscaled_global_norm(grads, optimizer)
        optimizer.update(model, grads)
        loss, aux = value if has_aux else (value, None)
        return outputs(loss, aux, grad_norm, optimizer)

    return train_step


def outputs(loss: Any, aux: Any, grad_norm: Any, optimizer: Any) -> tuple[Any, Any, Any]:
    """What a loss-scaled step returns after ``optimizer.update``: ``(loss, aux, grad_norm)``
    with the loss scale's metrics beside the aux (:func:`route_metrics` takes them out)."""
    now = metrics(nnx.as_pure(optimizer.opt_state))
    own = {PREFIX + k: v for k, v in now.items() if k in METRICS}
    return loss, {"aux": aux, _OWN: own}, grad_norm


def route_metrics(trainer: Any) -> None:
    """The trainer's ``_post_process_train_step`` (its hook for a step's aux), wrapped: the
    step's own metrics go into the buffer the trainer logs from, the aux to the hook. The
    first skipped step the trainer logs is also said, with why, in a log line."""
    hook = trainer._post_process_train_step
    reducers = {**METRICS, "skipped": _saying_the_first_skip(trainer)}

    def post_process(out: Any) -> Any:
        buffer = trainer._buffered_train_metrics.additional_metrics
        for name, value in out[_OWN].items():
            values, _ = buffer.setdefault(name, ([], reducers[name[len(PREFIX) :]]))
            values.append(value)  # a device array: the trainer reads it a step later
        return hook(out["aux"])

    trainer._post_process_train_step = post_process


def _saying_the_first_skip(trainer: Any) -> Callable[[list[Any]], Any]:
    """The reducer of ``skipped`` (the last value of the optimizer step), which logs a line
    the first time it reduces a skipped step: the trainer reduces when it writes its
    metrics, a step later, with the values already on the host (no sync of its own)."""
    told = False
    who = f"the {trainer.metrics_prefix} trainer" if trainer.metrics_prefix else "the trainer"

    def reduce(values: list[Any]) -> Any:
        nonlocal told
        last = values[-1]
        if not told and bool(np.asarray(last)):
            told = True
            LOG.warning(
                "lossscale_jax: %s skipped an optimizer step: its scaled gradients overflowed "
                "(inf or nan), so nothing was applied (the parameters and the optimizer's "
                "state and step are as they were) and the loss scale backed off "
                "(loss_scale/loss_scale). A dynamic scale starts high and halves until the "
                "gradients fit: the first steps of a fresh model often skip, and "
                "loss_scale/skipped_steps counts every skip. Said once per trainer.",
                who,
            )
        return last

    return reduce
