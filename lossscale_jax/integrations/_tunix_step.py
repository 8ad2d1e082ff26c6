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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lossscale_jax.access._access import get_loss_scale_state
from lossscale_jax.access._metrics import metrics
from lossscale_jax.gradients import unscaled_global_norm, value_and_grad


# lsj.metrics key -> how the values of one optimizer step's micro-batches are reduced: the
# last (after the window's decision), as the trainer logs it once per optimizer step.
def _last(values: list[Any]) -> Any:
    return values[-1]


def _first(values: list[Any]) -> Any:
    return values[0]


METRICS: dict[str, Callable[[list[Any]], Any]] = {
    **dict.fromkeys(("loss_scale", "skipped", "skipped_steps", "overflow_rate"), _last),
    "scale_used": _first,  # the scale the step's loss was multiplied by (a window's: constant)
}
PREFIX = "loss_scale/"
LOG = logging.getLogger("lossscale_jax.integrations.tunix")
_OWN = "lossscale_jax"  # the key of the step's own outputs in what it returns as aux
#: Optimizer steps skipped in a row, each one that no loss scale fixes (a non-finite loss, or
#: the policy's scale unable to go lower: ``lsj.metrics``' ``stuck``), before the log says
#: the run is stuck.
STUCK_AFTER = 3
# What a step says of itself for the log line beside ``skipped`` (one float32 vector per
# micro-batch, which the trainer brings to the host with its metrics): the positions.
_WHY = (
    "skipped",
    "loss_finite",
    "scale_used",
    "loss_scale",
    "stuck",
    "overflow_leaves",
    "first_overflow_leaf",
    "unlanded",
)


def make_train_step(trainer: Any) -> Callable[..., tuple[Any, Any, Any]]:
    """The loss-scaled ``(model, optimizer, inputs) -> (loss, aux, grad_norm)`` of ``trainer``."""
    leaves = Leaves()

    def train_step(model: Any, optimizer: Any, inputs: Any) -> tuple[Any, Any, Any]:
        inputs = trainer.gen_model_input_fn(inputs)
        has_aux = trainer._has_aux  # read when traced, as Tunix's own step reads them
        argnums = nnx.DiffState(0, nnx.LoRAParam) if trainer._lora_enabled else 0
        grad_fn = value_and_grad(trainer.loss_fn, optimizer, argnums=argnums, has_aux=has_aux)
        scale = get_loss_scale_state(nnx.as_pure(optimizer.opt_state)).scale  # before update
        value, grads = grad_fn(model, **inputs)
        leaves.note(grads)
        grad_norm = unscaled_global_norm(grads, optimizer)
        optimizer.update(model, grads)
        loss, aux = value if has_aux else (value, None)
        return outputs(loss, aux, grad_norm, optimizer, scale)

    trainer._lossscale_jax_leaves = leaves
    return train_step


class Leaves:
    """The key paths of the gradient leaves, noted when the step is traced (static): the log
    line names an overflowing leaf by its index among them."""

    paths: tuple[str, ...] = ()

    def note(self, grads: Any) -> None:
        flat = jax.tree_util.tree_flatten_with_path(nnx.as_pure(grads))[0]
        self.paths = tuple(jax.tree_util.keystr(p) for p, _ in flat)


def outputs(
    loss: Any, aux: Any, grad_norm: Any, optimizer: Any, scale: Any
) -> tuple[Any, Any, Any]:
    """What a loss-scaled step returns after ``optimizer.update``: ``(loss, aux, grad_norm)``
    with the loss scale's metrics beside the aux (:func:`route_metrics` takes them out);
    ``scale``: the loss scale the step's loss was multiplied by (read before the update)."""
    now = metrics(nnx.as_pure(optimizer.opt_state))
    own = {PREFIX + k: v for k, v in now.items() if k in METRICS}
    own[PREFIX + "scale_used"] = jnp.asarray(scale, jnp.float32)
    said = {**now, "scale_used": scale, "loss_finite": jnp.all(jnp.isfinite(loss))}
    said.setdefault("overflow_leaves", 0)
    said.setdefault("first_overflow_leaf", -1)
    own[PREFIX + "skipped"] = jnp.stack([jnp.asarray(said[k], jnp.float32) for k in _WHY])
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
    """The reducer of ``skipped`` (the last value of the optimizer step: each value is the
    vector ``_WHY`` names, the first entry the flag), which logs a line the first time it
    reduces a skipped step, and one when :data:`STUCK_AFTER` steps in a row were skipped and
    no loss scale would fix them: the trainer reduces when it writes its metrics, a step
    later, with the values already on the host (no sync of its own)."""
    told = {"first": False, "stuck": False}
    in_a_row = 0
    who = f"the {trainer.metrics_prefix} trainer" if trainer.metrics_prefix else "the trainer"

    def reduce(values: list[Any]) -> Any:
        nonlocal in_a_row
        rows: list[dict[str, float]] = [
            dict(zip(_WHY, np.asarray(v, np.float64).tolist(), strict=True)) for v in values
        ]
        last: dict[str, float] = dict(rows[-1])
        last["loss_finite"] = min(r["loss_finite"] for r in rows)  # any micro-batch's
        last["scale_used"] = rows[0]["scale_used"]
        skipped = bool(last["skipped"])
        helpless = not last["loss_finite"] or bool(last["stuck"])
        in_a_row = in_a_row + 1 if skipped and helpless else 0
        if skipped and not told["first"]:
            told["first"] = True
            LOG.warning("lossscale_jax: %s", first_skip(who, last, _paths(trainer)))
        if in_a_row >= STUCK_AFTER and not told["stuck"]:
            told["stuck"] = True
            LOG.warning("lossscale_jax: %s", stuck(who, last, in_a_row))
        return np.float32(last["skipped"])

    return reduce


def _paths(trainer: Any) -> tuple[str, ...]:
    leaves = getattr(trainer, "_lossscale_jax_leaves", None)
    return leaves.paths if leaves is not None else ()


def first_skip(who: str, why: dict[str, float], paths: tuple[str, ...]) -> str:
    """The line said at the first skipped step: what was not finite, what the policy did."""
    used, now = why["scale_used"], why["loss_scale"]
    if not why["loss_finite"]:
        what = (
            "its loss itself was not finite (inf or nan) before any loss scale touched it, "
            "so its gradients were not either"
        )
    elif why["unlanded"]:
        what = (
            "its update would have written inf or nan into a float16 parameter (the "
            "gradients were finite: the inner optimizer runs in float16)"
        )
    else:
        count, first = int(why["overflow_leaves"]), int(why["first_overflow_leaf"])
        named = ""
        if 0 <= first < len(paths):
            others = f" and {count - 1} other(s)" if count > 1 else ""
            named = f": the gradient of {paths[first]}{others}"
        what = f"its gradients, scaled by {used:.8g}, overflowed (inf or nan){named}"
    line = (
        f"{who} skipped an optimizer step: {what}. Nothing was applied (the parameters and "
        "the optimizer's state and step are as they were). "
    )
    if now < used:
        line += f"The loss scale backed off from {used:.8g} to {now:.8g} (loss_scale/loss_scale)"
        if not why["loss_finite"]:
            line += (
                ", which cannot help: no loss scale makes a non-finite loss finite; look at "
                "the batch and the model's forward pass."
            )
        else:
            line += (
                ". A dynamic scale starts high and halves until the gradients fit: the "
                "first steps of a fresh model often skip."
            )
    elif now > used:
        line += f"The loss scale moved from {used:.8g} to {now:.8g} (loss_scale/loss_scale)."
    else:
        line += f"The loss scale stayed at {used:.8g} (loss_scale/loss_scale)"
        if not why["loss_finite"]:
            line += (
                "; no loss scale makes a non-finite loss finite: look at the batch and the "
                "model's forward pass."
            )
        elif why["stuck"] and used == 1.0:
            line += (
                ": no loss scale was applied, so the gradients overflowed in the compute "
                "dtype itself; a scale does not help unless it is below 1 (a smaller "
                "loss, or lsj.StaticScale below 1)."
            )
        elif why["stuck"]:
            line += (
                ": this policy does not lower it (a fixed scale, or a dynamic one at its "
                "floor), so the same gradients overflow again; a lower scale, or "
                "lsj.DynamicScale(), lets them fit."
            )
        else:
            line += " (a dynamic scale with hysteresis backs off after more overflows)."
    return line + " loss_scale/skipped_steps counts every skip. Said once per trainer."


def stuck(who: str, why: dict[str, float], in_a_row: int) -> str:
    """The line said when the run is stuck: every recent step skipped, no scale to fix it."""
    if not why["loss_finite"]:
        cause = "the loss itself is not finite, which no loss scale fixes"
    else:
        cause = (
            f"the gradients overflow at a loss scale of {why['loss_scale']:.8g}, which this "
            "policy does not lower (a fixed scale, or a dynamic one at its floor)"
        )
    return (
        f"{who} is stuck: its last {in_a_row} optimizer steps were all skipped, nothing "
        f"applied, and {cause}. Every further step will skip the same way; stop the run and "
        "fix the cause. Said once per trainer."
    )
