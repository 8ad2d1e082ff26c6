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

from lossscale_jax.gradients import unscaled_global_norm, value_and_grad
from lossscale_jax.integrations._host import _metrics


# The scale's metrics -> how the values of one optimizer step's micro-batches are reduced:
# the last (after the window's decision), as the trainer logs it once per optimizer step.
def _last(values: list[Any]) -> Any:
    return values[-1]


def _first(values: list[Any]) -> Any:
    return values[0]


METRICS: dict[str, Callable[[list[Any]], Any]] = {
    **dict.fromkeys(_metrics.KEYS, _last),
    "scale_used": _first,  # the scale the step's loss was multiplied by (a window's: constant)
}
PREFIX = _metrics.PREFIX
LOG = logging.getLogger("lossscale_jax.integrations.tunix")
_OWN = "lossscale_jax"  # the key of the step's own outputs in what it returns as aux


def make_train_step(trainer: Any) -> Callable[..., tuple[Any, Any, Any]]:
    """The loss-scaled ``(model, optimizer, inputs) -> (loss, aux, grad_norm)`` of ``trainer``."""
    leaves = _metrics.Leaves()

    def train_step(model: Any, optimizer: Any, inputs: Any) -> tuple[Any, Any, Any]:
        inputs = trainer.gen_model_input_fn(inputs)
        has_aux = trainer._has_aux  # read when traced, as Tunix's own step reads them
        argnums = nnx.DiffState(0, nnx.LoRAParam) if trainer._lora_enabled else 0
        grad_fn = value_and_grad(trainer.loss_fn, optimizer, argnums=argnums, has_aux=has_aux)
        scale = _metrics.scale_used(nnx.as_pure(optimizer.opt_state))  # before the update
        value, grads = grad_fn(model, **inputs)
        leaves.note(nnx.as_pure(grads))
        grad_norm = unscaled_global_norm(grads, optimizer)
        optimizer.update(model, grads)
        loss, aux = value if has_aux else (value, None)
        return outputs(loss, aux, grad_norm, optimizer, scale)

    trainer._lossscale_jax_leaves = leaves
    return train_step


def outputs(
    loss: Any, aux: Any, grad_norm: Any, optimizer: Any, scale: Any
) -> tuple[Any, Any, Any]:
    """What a loss-scaled step returns after ``optimizer.update``: ``(loss, aux, grad_norm)``
    with the loss scale's metrics beside the aux (:func:`route_metrics` takes them out);
    ``scale``: the loss scale the step's loss was multiplied by (read before the update)."""
    opt_state = nnx.as_pure(optimizer.opt_state)
    own = _metrics.scale_metrics(opt_state, scale)
    own[PREFIX + "skipped"] = _metrics.why(loss, opt_state, scale)  # the reducer says it
    if _is_loss_output(aux):  # Tunix's loop buffers its metrics itself (route_metrics)
        return loss, aux.replace(aux_metrics={**aux.aux_metrics, **own}), grad_norm
    return loss, {"aux": aux, _OWN: own}, grad_norm


def _is_loss_output(aux: Any) -> bool:
    """Whether ``aux`` is a ``LossOutput`` of Tunix's main branch (a loss and its metrics)."""
    return type(aux).__name__ == "LossOutput" and hasattr(aux, "aux_metrics")


def route_metrics(trainer: Any) -> None:
    """The trainer's ``_post_process_train_step`` (its hook for a step's aux), wrapped: the
    step's own metrics go into the buffer the trainer logs from, the aux to the hook. The
    first skipped step the trainer logs is also said, with what was not finite and what the
    policy did, in a log line; a run that no loss scale can fix, in another."""
    hook = trainer._post_process_train_step
    reducers = {**METRICS, "skipped": _saying_what_happened(trainer)}

    def post_process(out: Any) -> Any:
        buffer = trainer._buffered_train_metrics.additional_metrics
        if isinstance(out, dict) and _OWN in out:
            for name, value in out[_OWN].items():
                values, _ = buffer.setdefault(name, ([], reducers[name[len(PREFIX) :]]))
                values.append(value)  # a device array: the trainer reads it a step later
            return hook(out["aux"])
        # A LossOutput's metrics (Tunix's main branch): the loop buffered them, ours among
        # them, with its reducer; ours get their own, and the hook the others.
        mine = [name for name in out if name.startswith(PREFIX) and name in buffer]
        for name in mine:
            buffer[name] = (buffer[name][0], reducers[name[len(PREFIX) :]])
        return hook({k: v for k, v in out.items() if k not in mine})

    trainer._post_process_train_step = post_process


def _saying_what_happened(trainer: Any) -> Callable[[list[Any]], Any]:
    """The reducer of ``skipped`` (each value the vector ``_metrics.WHY`` names, the first
    entry the flag): it reduces to the step's flag and tells ``_metrics.Teller`` what the step
    was. The trainer reduces when it writes its metrics, a step later, with the values
    already on the host (no sync of its own)."""
    who = f"the {trainer.metrics_prefix} trainer" if trainer.metrics_prefix else "the trainer"
    teller = _metrics.Teller(LOG, who, getattr(trainer, "_lossscale_jax_leaves", None))

    def reduce(values: list[Any]) -> Any:
        return np.float32(teller.seen(values))

    return reduce
