"""PyTorch ``torch.amp.GradScaler`` (``torch/amp/grad_scaler.py``).

``GradScaler`` builds the policy; ``import_state``/``export_state`` read and
write ``GradScaler.state_dict()``; ``multi_optimizer`` is one scaler stepping
several optimizers, each skipped only for its own overflow.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from lossscale_jax import numerics, policies
from lossscale_jax.compat._common import (
    _INF,
    _TINY,
    _bool,
    _build,
    _check_policy,
    _clip,
    _field,
    _host,
    _int,
    _number,
    _require_policy,
    _resumed,
    _saved_int,
    _saved_scale,
)
from lossscale_jax.policies import LossScalePolicy, LossScaleState, NoScale
from lossscale_jax.transform import (
    AxisName,
    LossScalingState,
    _validate_axis_name,
    reduce_overflow,
)

__all__ = [
    "GradScaler",
    "import_state",
    "export_state",
    "multi_optimizer",
]

_STATE_DICT_KEYS = (
    "scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "_growth_tracker",
)


def GradScaler(
    device: str = "cuda",
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    enabled: bool = True,
) -> LossScalePolicy:
    """``torch.amp.GradScaler``: halve on inf/nan, double after 2000 good steps.

    Rule (``_amp_update_scale_`` in
    ``aten/src/ATen/native/cuda/AmpKernels.cu`` and
    ``aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp``)::

      if found_inf:
          scale = scale * backoff_factor; growth_tracker = 0
      elif growth_tracker + 1 == growth_interval:
          if isfinite(scale * growth_factor): scale = scale * growth_factor
          growth_tracker = 0
      else:
          growth_tracker += 1

    Torch multiplies the float32 scale by a double factor; the result is
    the same float32 number whenever the factor is itself a float32
    number (2, 0.5, 0.75, ...). Torch has no floor; here the scale stops
    at ``2**-126``. ``enabled=False`` gives ``NoScale()`` (no skipping).

    Args:
      device: accepted for signature compatibility; placement is JAX's.
      init_scale, growth_factor, backoff_factor, growth_interval, enabled:
        as in torch.

    Returns:
      A ``DynamicScale`` (or ``NoScale`` when not enabled).

    Examples:
      >>> from lossscale_jax import compat
      >>> float(compat.torch.GradScaler().init().scale)
      65536.0
    """
    if not isinstance(device, str):
        raise TypeError(f"device must be a str such as 'cuda', got {device!r}.")
    if not _bool("enabled", enabled):
        return NoScale()
    growth = _number("growth_factor", growth_factor)
    backoff = _number("backoff_factor", backoff_factor)
    if not growth > 1.0:
        raise ValueError(f"The growth factor must be > 1.0, got growth_factor={growth_factor!r}.")
    if not backoff < 1.0:
        raise ValueError(
            f"The backoff factor must be < 1.0, got backoff_factor={backoff_factor!r}."
        )
    return _build(
        policies.DynamicScale,
        {},
        init_scale=_number("init_scale", init_scale),
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=_int("growth_interval", growth_interval),
        min_scale=_TINY,
        max_scale=_INF,
    )


def import_state(state_dict: Mapping[str, Any]) -> tuple[LossScalePolicy, LossScaleState]:
    """The policy and state of a ``GradScaler.state_dict()``, to resume a torch run.

    Rule (``GradScaler.load_state_dict``: the factors and interval come with
    the scale)::

      policy = GradScaler(init_scale=scale, growth_factor=growth_factor,
                          backoff_factor=backoff_factor, growth_interval=growth_interval)
      state = policy.init() with growth_count = _growth_tracker

    The saved scale is kept as it is (inside ``[2**-126, inf)``, this
    library's floor). A state built this way runs with the saved
    hyperparameters, as torch's ``load_state_dict`` does; put it into a
    state built with another policy and that policy's hyperparameters apply.

    Args:
      state_dict: ``scaler.state_dict()`` as torch returns it: ``scale``
        (float), ``growth_factor``, ``backoff_factor`` (floats),
        ``growth_interval`` and ``_growth_tracker`` (ints). Tensors or NumPy
        scalars are accepted in place of the numbers.

    Returns:
      ``(policy, state)``: a ``DynamicScale`` as ``GradScaler(...)`` builds
      it and a ``LossScaleState`` (put it in with
      ``lossscale_jax.set_loss_scale_state``).

    Raises:
      ValueError: for an empty dict (saved from a disabled scaler, as torch
        says), a missing key, a scale that is not finite and > 0, or a
        tracker outside ``[0, growth_interval)``.

    Examples:
      >>> from lossscale_jax import compat
      >>> policy, state = compat.torch.import_state({
      ...     "scale": 32768.0, "growth_factor": 2.0, "backoff_factor": 0.5,
      ...     "growth_interval": 2000, "_growth_tracker": 1500})
      >>> float(state.scale), int(state.growth_count), policy.growth_interval
      (32768.0, 1500, 2000)
    """
    if isinstance(state_dict, Mapping) and len(state_dict) == 0:
        raise ValueError(
            "The source state dict is empty, possibly because it was saved from a disabled "
            "instance of GradScaler (use compat.torch.GradScaler(enabled=False), which has no "
            "state)."
        )
    what = "the GradScaler state_dict"
    scale = _saved_scale("scale", _field(state_dict, "scale", what))
    interval = _saved_int("growth_interval", _field(state_dict, "growth_interval", what), 1)
    policy = GradScaler(
        init_scale=_clip(scale, _TINY, _INF),
        growth_factor=_number("growth_factor", _field(state_dict, "growth_factor", what)),
        backoff_factor=_number("backoff_factor", _field(state_dict, "backoff_factor", what)),
        growth_interval=interval,
    )
    tracker = _saved_int(
        "_growth_tracker", _field(state_dict, "_growth_tracker", what), 0, interval - 1
    )
    return policy, _resumed(policy, growth_count=tracker)


def export_state(policy: LossScalePolicy, state: LossScaleState) -> dict[str, Any]:
    """The ``GradScaler.state_dict()`` of a policy and state, to continue in torch.

    Rule::

      {"scale": state.scale, "growth_factor": policy.growth_factor,
       "backoff_factor": policy.backoff_factor,
       "growth_interval": policy.growth_interval, "_growth_tracker": state.growth_count}
      NoScale() -> {}                              # a disabled scaler's state_dict

    Load it with ``torch.amp.GradScaler().load_state_dict(d)``. Reads the
    state on the host (call it outside ``jit``, when checkpointing).

    Args:
      policy: a policy built by ``compat.torch.GradScaler`` (or
        ``import_state``).
      state: its ``LossScaleState`` (``lsj.get_loss_scale_state(opt_state)``).

    Returns:
      A dict of Python floats and ints, torch's keys.

    Raises:
      ValueError: if ``policy`` is not one ``GradScaler`` can express (e.g.
        hysteresis, bounds). TypeError: if ``state`` is not a ``LossScaleState``.

    Examples:
      >>> from lossscale_jax import compat
      >>> policy = compat.torch.GradScaler(init_scale=8.0, growth_interval=3)
      >>> saved = compat.torch.export_state(policy, policy.adjust(policy.init(), False))
      >>> saved["scale"], saved["growth_interval"], saved["_growth_tracker"]
      (8.0, 3, 1)
    """
    if isinstance(policy, NoScale) and not policy.skip_on_overflow:
        _host(state)
        return {}
    if not isinstance(policy, policies.DynamicScale):
        raise ValueError(
            f"policy {policy!r} has no torch equivalent: export needs a policy built by "
            "compat.torch.GradScaler."
        )
    expected = GradScaler(
        init_scale=policy.init_scale,
        growth_factor=policy.growth_factor,
        backoff_factor=policy.backoff_factor,
        growth_interval=policy.growth_interval,
    )
    _require_policy(policy, expected, "torch", "compat.torch.GradScaler")
    scale, count, _ = _host(state)
    return dict(
        zip(
            _STATE_DICT_KEYS,
            (
                scale,
                float(policy.growth_factor),
                float(policy.backoff_factor),
                int(policy.growth_interval),
                count,
            ),
            strict=True,
        )
    )


# --------------------------------------------------------------------------
# One GradScaler, several optimizers.


_DECISION = "lossscale_torch_decision"


def _skips_own_overflow(label: Hashable, inner: Any) -> optax.GradientTransformationExtraArgs:
    """``inner`` on its partition, unscaled, and skipped when its own gradients overflowed."""
    inner = optax.with_extra_args_support(inner)

    def update_fn(updates, state, params=None, **extra_args):
        applies, scale = extra_args.pop(_DECISION)

        def good(operands):
            grads, inner_state = operands
            grads = numerics.unscale(grads, scale, params)
            return inner.update(grads, inner_state, params, **extra_args)

        shapes = jax.eval_shape(good, (updates, state))[0]

        def skip(operands):
            zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            return zeros, operands[1]

        return lax.cond(applies[label], good, skip, (updates, state))

    return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def multi_optimizer(
    transforms: Mapping[Hashable, optax.GradientTransformation],
    param_labels: Any | Callable[[Any], Any],
    grad_scaler: LossScalePolicy,
    *,
    overflow: numerics.OverflowMode = "ieee",
    compute_dtype: Any = jnp.float16,
    axis_name: AxisName | None = None,
) -> optax.GradientTransformationExtraArgs:
    """One ``GradScaler`` stepping several optimizers, as torch does.

    In torch, ``scaler.step(opt0); scaler.step(opt1); scaler.update()``
    skips only the optimizer whose own gradients held an inf or nan, steps
    the others, and backs the one scale off if any of them overflowed. This
    is that step over the partitions of ``optax.multi_transform``.

    Rule (one ``update``; the gradients are those of ``scale_loss(loss, state)``)::

      found[k] = any overflow in the gradients labelled k   # reduced over axis_name
      loss_scale = grad_scaler.adjust(loss_scale, any(found))
      for each label k:
          if found[k] and loss_scale.last_skipped: zeros for k, k's state kept
          else: updates for k, state = transforms[k].update(grads[k] / scale, ...)

    ``metrics(opt_state)["skipped"]`` is True when any optimizer skipped.
    One ``loss_scaling`` around ``optax.multi_transform`` instead skips every
    partition together (one decision for the whole model), which is what
    the other frameworks do; choose that unless you port a torch recipe.

    Args:
      transforms: label -> optax transformation (torch's optimizers).
      param_labels: a pytree of labels (a prefix of the params) or a function
        of the params returning one, as for ``optax.multi_transform``.
      grad_scaler: the policy, e.g. ``compat.torch.GradScaler(...)``.
      overflow: the overflow check (``"ieee"``, torch's).
      compute_dtype: the dtype of the backward pass.
      axis_name: ``pmap``/``shard_map`` axis over which each partition's
        flag is reduced (one scalar collective per label).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      ``LossScalingState`` (``scale_loss``, ``metrics`` work on it).

    Raises:
      TypeError: if ``transforms`` is not a non-empty mapping or ``grad_scaler`` not a
        policy. ValueError: for a bad ``overflow`` or ``axis_name``, or a ``grad_scaler``
        that sets its scale from the gradients' range (``HeadroomScale``).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> from lossscale_jax import compat
      >>> params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
      >>> tx = compat.torch.multi_optimizer(
      ...     {"a": optax.sgd(1.0), "b": optax.sgd(1.0)}, {"a": "a", "b": "b"},
      ...     compat.torch.GradScaler(init_scale=4.0))
      >>> grads = {"a": jnp.array([4.0, 8.0]), "b": jnp.array([jnp.inf, 0.0])}
      >>> updates, state = tx.update(grads, tx.init(params), params)
      >>> updates["a"].tolist(), updates["b"].tolist(), float(state.loss_scale.scale)
      ([-1.0, -2.0], [0.0, 0.0], 2.0)
    """
    policy = _check_policy("grad_scaler", grad_scaler)
    if policy.measures_range:
        raise ValueError(
            f"grad_scaler={policy!r} sets its scale from the gradients' range, which "
            "multi_optimizer does not measure (torch's GradScaler has no such policy): use "
            "compat.torch.GradScaler(...), or lossscale_jax.loss_scaling(optax.multi_transform"
            "(...), policy) for one decision over every partition."
        )
    if not isinstance(transforms, Mapping) or not transforms:
        raise TypeError(
            f"transforms must be a non-empty mapping of label -> optax transformation, got "
            f"{transforms!r}."
        )
    mode = numerics.validate_overflow_mode(overflow)
    dtype = numerics.validate_compute_dtype(compute_dtype)
    _validate_axis_name(axis_name)
    partition = optax.multi_transform(
        {k: _skips_own_overflow(k, t) for k, t in transforms.items()}, param_labels
    )

    def init_fn(params: optax.Params) -> LossScalingState:
        return LossScalingState(loss_scale=policy.init(), inner_state=partition.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, LossScalingState):
            raise TypeError(
                "state must be the LossScalingState made by this transformation's init, got "
                f"{type(state).__name__}."
            )
        labels = param_labels(updates) if callable(param_labels) else param_labels
        found = {}
        for k in transforms:
            mine = jax.tree_util.tree_map(
                lambda lab, g, k=k: g if lab == k else None, labels, updates
            )
            found[k] = reduce_overflow(numerics.check_overflow(mine, mode, dtype), axis_name)
        loss_scale = policy.adjust(state.loss_scale, jnp.any(jnp.stack(list(found.values()))))
        applies = {
            k: jnp.logical_not(jnp.logical_and(f, loss_scale.last_skipped))
            for k, f in found.items()
        }
        new_updates, inner_state = partition.update(
            updates,
            state.inner_state,
            params,
            **extra_args,
            **{_DECISION: (applies, state.loss_scale.scale)},
        )
        return new_updates, LossScalingState(loss_scale=loss_scale, inner_state=inner_state)

    # leaf_overflow may be None (no record): a leafless pytree optax's OptState alias omits.
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
