"""PyTorch ``torch.amp.GradScaler`` (``torch/amp/grad_scaler.py``)."""

from __future__ import annotations

from lossscale_jax import policies
from lossscale_jax.compat._common import (
    _INF,
    _TINY,
    _bool,
    _build,
    _int,
    _number,
)
from lossscale_jax.policies import LossScalePolicy, NoScale


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
