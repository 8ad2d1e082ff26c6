"""PyTorch ``torch.amp.GradScaler`` (``torch/amp/grad_scaler.py``).

``GradScaler`` builds the policy; ``import_state``/``export_state`` read and
write ``GradScaler.state_dict()``; ``multi_optimizer`` is one scaler stepping
several optimizers, each skipped only for its own overflow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _INF,
    _TINY,
    _bool,
    _build,
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
from lossscale_jax.compat._torch_multi import multi_optimizer
from lossscale_jax.policies import LossScalePolicy, LossScaleState, NoScale

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
