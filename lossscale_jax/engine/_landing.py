"""Where an update lands: float16 parameters, their master copies, and the last check.

A float16 parameter updated by an optimizer that runs in float16 (``optax.adam``'s ``eps``
of 1e-8 is 0 there, its second moment underflows to 0) can be written inf or nan by a step
whose gradients were finite: the overflow check reads the gradients only. So, for a
front-end given float16 parameters, the update is computed before the decision and the
values it would write are checked too (:func:`landing_flags`): a step that would write a
non-finite float16 parameter is *unlanded* (``Check.unlanded``): skipped, its leaves
recorded, reported as such (``metrics``' ``unlanded`` and ``stuck``; ``on_stuck="error"``
names the leaves and ``lsj.master_weights``), and not an overflow of the gradients: the
scale stays (no scale changes where an update lands) and ``overflow_rate`` counts the
gradients' overflows alone. Nothing non-finite ever reaches the parameters. Its ``init``
warns (``Float16OptimizerWarning``, naming the leaves) unless the inner optimizer keeps
float32 master copies (``lsj.master_weights``, whose state :func:`holds_master` finds): then
the gradients are unscaled into float32 for it (:func:`unscale_targets`), never into
float16.

``loss_scaling`` does not add the master copies itself: they change the optimizer state (its
checkpoints) and its memory (4 bytes per parameter, and the inner state in float32), and an
inner optimizer that lands in float16 (SGD, an Adam with an ``eps`` float16 holds) has no
need of them; the warning at ``init`` and the step's report name the one call that adds them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp

from lossscale_jax.engine import _devices
from lossscale_jax.engine._engine import Check, Engine
from lossscale_jax.engine._opt_states import MasterWeightsState
from lossscale_jax.engine._stuck import named_leaves
from lossscale_jax.engine._unscale import scale_is_bad
from lossscale_jax.errors import Float16OptimizerWarning


def is_float16(x: Any) -> bool:
    return getattr(x, "dtype", None) == jnp.float16


def float16_leaves(params: Any) -> list[str]:
    """The paths of the float16 leaves of ``params`` (``None`` params: none)."""
    if params is None:
        return []
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [jax.tree_util.keystr(path) for path, p in flat if is_float16(p)]


def holds_master(inner_state: Any) -> bool:
    """Whether an inner optimizer's state holds a ``master_weights`` state."""

    def marked(x: Any) -> bool:
        return isinstance(x, MasterWeightsState)

    leaves = jax.tree_util.tree_leaves(inner_state, is_leaf=marked)
    return any(marked(x) for x in leaves)


def unscale_targets(params: Any, inner_state: Any) -> Any:
    """The dtype targets of the unscale (``Engine.unscale``'s ``params``): the parameters, or
    none (float16 gradients unscaled into float32) when the inner keeps master copies."""
    return None if holds_master(inner_state) else params


def warn_float16_inner(params: Any, inner_state: Any, where: str) -> None:
    """Warns when float16 parameters meet an inner optimizer without master copies."""
    leaves = float16_leaves(params)
    if not leaves or holds_master(inner_state):
        return
    warnings.warn(
        f"{where}: the parameters {named_leaves(leaves)} are float16, and the inner optimizer "
        "would run in float16: its state and every update land in float16 (optax.adam's "
        "eps=1e-8 is 0 there, its second moment underflows to 0 and the update is inf or nan; "
        "an update under half a float16 ulp is lost). Steps that would write inf or nan are "
        "skipped (lsj.metrics(opt_state)['unlanded'] and ['stuck'] say so; on_stuck='error' "
        "stops there), so nothing non-finite reaches the parameters, but training may not "
        "progress. Keep float32 master copies in the optimizer: "
        "lsj.loss_scaling(lsj.master_weights(inner), policy), or keep float32 parameters and "
        "compute in float16.",
        Float16OptimizerWarning,
        stacklevel=3,  # the call of the front-end's init
    )


def landing_flags(params: Any, updates: Any) -> jax.Array:
    """``bool[n]``, one per leaf of ``params``: the update would write a non-finite value
    into that float16 parameter (``optax.apply_updates``' result); ``False`` elsewhere."""
    ps = jax.tree_util.tree_leaves(params)
    us = jax.tree_util.tree_leaves(updates)
    flags = []
    for p, u in zip(ps, us, strict=True):
        if is_float16(p):
            wide = jnp.promote_types(p.dtype, u.dtype)  # optax.apply_updates' p + u
            landed = (p.astype(wide) + u.astype(wide)).astype(p.dtype)
            flags.append(jnp.logical_not(jnp.all(jnp.isfinite(landed))))
        else:
            flags.append(jnp.zeros([], jnp.bool_))
    return jnp.stack(flags) if flags else jnp.zeros([0], jnp.bool_)


def check_landing(
    engine: Engine,
    check: Check,
    params: Any,
    updates: Any,
    scale: jax.Array,
    when: jax.Array | None = None,
    *,
    reduce_flags: bool = False,
) -> Check:
    """``check`` with the update's landing: ``unlanded`` (an update would write inf or nan
    into a float16 parameter on some device), its per-leaf flags (reduced over ``axis_name``
    as the check's flags are, ``reduce_flags``: as ``Engine.check``'s), and the record's
    flags ORed with them where the gradients did not overflow (``when``: only where it is
    true, a window's end). A ``scale`` that is not finite and > 0 makes every unscaled
    gradient nan: that overflow is the scale's, no leaf's (nothing unlanded).

    Rule::

      flags = landing_flags(params, updates) and scale finite and > 0 (and when)
      unlanded, flags = any(flags), flags                  # reduced over axis_name
      record = record or (flags and not overflow)          # the leaves that stopped the step
    """
    flags = jnp.logical_and(landing_flags(params, updates), jnp.logical_not(scale_is_bad(scale)))
    if when is not None:
        flags = jnp.logical_and(flags, when)
    shared = check.flags is not None and (reduce_flags or engine.attribution == "reduced")
    bad, _, reduced = _devices.reduce_packed(
        jnp.any(flags), None, flags if shared else None, engine.axis_name
    )
    if shared:
        flags = cast(jax.Array, reduced)
    record = None
    if check.flags is not None:
        record = jnp.logical_or(
            check.flags, jnp.logical_and(flags, jnp.logical_not(check.overflow))
        )
    return check._replace(
        flags=record,
        unlanded=bad,
        unlanded_flags=flags if shared else None,
        float16_leaves=tuple(float16_leaves(params)),
    )


def land_first(
    engine: Engine,
    check: Check,
    params: Any,
    inner_update: Callable,
    grads: Any,
    inner_state: Any,
    scale: jax.Array,
    when: jax.Array | None = None,
) -> tuple[Check, Callable]:
    """``(check, inner_update)``: where ``params`` hold float16 leaves, the update computed
    before the decision and where it would land checked (``check_landing``), with an
    ``inner_update`` that returns it; elsewhere both as given (the update computed only
    where it is applied)."""
    if not float16_leaves(params):
        return check, inner_update
    landed = inner_update(grads, inner_state)
    return check_landing(engine, check, params, landed[0], scale, when), lambda *_: landed
