"""What happened, for logging: ``metrics`` (on the device) and ``overflowed_leaves`` (host)."""

from __future__ import annotations

from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from lossscale_jax.engine._division import ratio_of_counts
from lossscale_jax.engine._nesting import locate
from lossscale_jax.engine._ops import where


def metrics(opt_state: Any) -> dict[str, jax.Array]:
    """A flat dict of scalars for logging, computed without leaving the device.

    Keys:

    - ``loss_scale`` (float32);
    - ``overflow``, ``skipped``, ``stuck``, ``unlanded`` (bool, the last step;
      ``overflow``: its gradients overflowed; ``unlanded``: it was skipped although they
      did not, because its update would have written inf or nan into a float16 parameter
      (an inner optimizer that runs in float16: ``lsj.master_weights`` fixes it);
      ``stuck``: no loss scale fixes the skip, the gradients overflowed with the scale
      already at its floor, or the step is unlanded);
    - ``total_steps``, ``overflow_steps``, ``skipped_steps`` (int32);
    - ``overflow_rate`` (float32): ``overflow_steps / total_steps``, 0 before
      the first step (rounded once, as IEEE divides, on every backend): the
      gradients' overflows alone (an unlanded step is skipped, not an overflow);
    - ``recent_overflow_rate`` (float32): the fraction of recent steps that
      overflowed (``LossScaleState.recent_overflow_rate``). For the first 2000
      steps it is ``overflow_rate`` (the mean so far); after that an
      exponential moving average of the overflow flag with weight 1/2000
      (a step's weight halves in about 1400 steps), started from that mean.
      Alert on it mid-run: keep it under 0.5% (0.1% for a large global batch),
      the guideline of Huawei's Ascend (CANN) mixed-precision training guide;
    - when the state keeps a per-leaf overflow record (``loss_scaling``'s
      ``attribution``, on by default): ``overflow_leaves`` (int32, how many
      gradient leaves overflowed at the last step) and ``first_overflow_leaf``
      (int32, the index in ``jax.tree_util.tree_leaves(params)`` of the first
      one, -1 if none); on an unlanded step, the leaves whose update would not
      land. ``overflowed_leaves(opt_state, params)`` names them.

    Under accumulation (``loss_scaling_multi_steps``) a step is a window, and
    every key describes the last completed window, also when read between its
    micro-batches (the window in progress is in the state: ``window_overflow``,
    ``window_leaf_overflow``). An overflow caused by a bad scale in the state
    (not finite, or <= 0) flags no leaf.

    Rule::

      unlanded = last_skipped and not last_overflow             # every library policy
                                                                # skips only on an overflow
      rate = overflow_steps / total_steps                       # 0 before the first step
      recent = rate if total_steps <= 2000                      # updated at each step
               else recent + (overflow - recent) / 2000
      overflow_leaves = sum(leaf_overflow)
      first_overflow_leaf = argmax(leaf_overflow) if any(leaf_overflow) else -1

    Args:
      opt_state: an optimizer state holding a ``LossScaleState`` (as
        ``get_loss_scale_state`` finds it), or a ``LossScaleState``.

    Returns:
      A dict of scalar arrays (keys above).

    Raises:
      ValueError: as ``get_loss_scale_state``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> params = {"a": jnp.ones(2), "b": jnp.ones(3)}
      >>> tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=8.0))
      >>> state = tx.init(params)
      >>> _, state = tx.update({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf, 1.0])},
      ...                      state, params)
      >>> m = lsj.metrics(state)
      >>> float(m["loss_scale"]), float(m["recent_overflow_rate"])
      (4.0, 1.0)
      >>> int(m["overflow_leaves"]), int(m["first_overflow_leaf"])   # leaf 1: "b"
      (1, 1)
    """
    s, owner = locate(opt_state)
    # Rounded once, with integer operations: the same bits on every backend (_division).
    rate = where(
        s.total_steps > 0, ratio_of_counts(s.overflow_steps, s.total_steps), jnp.float32(0.0)
    )
    out = {
        "loss_scale": s.scale,
        "overflow": s.last_overflow,
        "skipped": s.last_skipped,
        "stuck": s.stuck,
        "unlanded": jnp.logical_and(s.last_skipped, jnp.logical_not(s.last_overflow)),
        "total_steps": s.total_steps,
        "overflow_steps": s.overflow_steps,
        "skipped_steps": s.skipped_steps,
        "overflow_rate": rate.astype(jnp.float32),
        "recent_overflow_rate": s.recent_overflow_rate,
    }
    record = getattr(owner, "leaf_overflow", None)
    if record is not None:
        record = jnp.asarray(record, jnp.bool_)
        count = jnp.sum(record, axis=-1, dtype=jnp.int32)
        if record.shape[-1] == 0:
            first = jnp.full(count.shape, -1, jnp.int32)
        else:
            first = where(count > 0, jnp.argmax(record, axis=-1), -1).astype(jnp.int32)
        out["overflow_leaves"] = count
        out["first_overflow_leaf"] = first
    return out


def overflowed_leaves(opt_state: Any, params: Any) -> list[str]:
    """The key paths of the gradient leaves that overflowed at the last step (host side).

    Reads the per-leaf overflow record of the state (``leaf_overflow`` of
    ``LossScalingState`` / ``LossScalingMultiStepsState``) back to the host:
    this synchronises with the device (it waits for the step that produced
    the state), so call it outside ``jax.jit``, when logging, e.g. when
    ``metrics(opt_state)["overflow"]`` is set. Inside ``jit`` use
    ``metrics(...)["overflow_leaves"]`` and ``["first_overflow_leaf"]``.

    Rule::

      flags = device_get(leaf_overflow)                # one flag per leaf of params
      return [keystr(path) for (path, _), flag in zip(leaves_with_path(params), flags)
              if flag]

    What the record holds: with ``attribution="reduced"`` (the default) the
    leaves that overflowed on any device of ``axis_name``; with ``"local"``
    this device's own; under ``loss_scaling_multi_steps``, those that
    overflowed in any micro-batch of the last completed window. An overflow that comes from a bad
    scale in the state, not from a gradient, names no leaf.

    Args:
      opt_state: an optimizer state made by ``loss_scaling`` or
        ``loss_scaling_multi_steps`` (as ``get_loss_scale_state`` finds it).
        Under ``jax.pmap`` pass one device's state (``tree_map(lambda x: x[i],
        state)``).
      params: the parameters given to ``tx.init``, or any pytree of the same
        structure (only its key paths are read).

    Returns:
      Key paths as ``jax.tree_util.keystr`` writes them (e.g.
      ``"['params']['Dense_0']['kernel']"``), in leaf order; empty when no leaf
      overflowed.

    Raises:
      ValueError: as ``get_loss_scale_state``; if the state keeps no record
        (``attribution=None``, a bare ``LossScaleState``); if ``params`` has
        another number of leaves than the record; if the state holds one record
        per device.
      TypeError: when called on traced values (inside ``jit``).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}}
      >>> tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale())
      >>> grads = {"dense": {"kernel": jnp.full((2, 2), jnp.nan), "bias": jnp.ones(2)}}
      >>> _, state = tx.update(grads, tx.init(params), params)
      >>> lsj.overflowed_leaves(state, params)
      ["['dense']['kernel']"]
    """
    _, owner = locate(opt_state)
    record = getattr(owner, "leaf_overflow", None)
    if record is None:
        raise ValueError(
            "opt_state keeps no per-leaf overflow record: build the optimizer with "
            "lossscale_jax.loss_scaling(...) or loss_scaling_multi_steps(...) with "
            "attribution='reduced' (the default) or 'local', and its state with tx.init(params)."
        )
    if isinstance(record, jax.core.Tracer):
        raise TypeError(
            "overflowed_leaves reads the per-leaf overflow record back to the host and cannot "
            "run inside jax.jit (or another transformation): call it on the state the step "
            "returned, or use metrics(opt_state)['overflow_leaves'] inside the step."
        )
    flags = np.asarray(jax.device_get(record))
    if flags.ndim != 1:
        raise ValueError(
            f"opt_state holds per-leaf overflow records of shape {flags.shape}, one per device "
            "(a state from jax.pmap): pass one device's state, e.g. "
            "jax.tree_util.tree_map(lambda x: x[0], opt_state)."
        )
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    if len(paths) != flags.shape[0]:
        raise ValueError(
            f"params has {len(paths)} leaves but the optimizer state's per-leaf overflow "
            f"record has {flags.shape[0]}: pass the parameters given to tx.init (or a pytree "
            "of the same structure)."
        )
    return [path for path, flag in zip(paths, flags, strict=True) if flag]
