"""The loss scalers RL and LLM training stacks ship, by name: ``policy=lsj.presets.<name>()``.

Each preset is a policy built by the ``compat`` constructor of the framework whose rule it
runs (step for step, as ``lsj.compat`` reproduces it), with the settings that stack uses, so
a run ported from it does not have to copy numbers:

==================  ====================================================  ================
preset              rule and settings                                     from
==================  ====================================================  ================
``torch_amp``       torch's: 2**16, x2 after 2000 good steps, /2          ``GradScaler()``
``precision_rl``    torch's, x2 after 400 good steps                      Precision-RL
``verl_megatron``   Megatron's: 2**15, min 1, window 1000, hysteresis 2   verl's Megatron
``megatron_lm``     Megatron's: 2**32, min 1, window 1000, hysteresis 2   Megatron-LM
``deepspeed_fp16``  DeepSpeed's: 2**16, min 1, window 1000, hysteresis 2  DeepSpeed fp16
==================  ====================================================  ================

``precision_rl`` is what Qi et al. train with (``ShardedGradScaler(growth_interval=400)`` in
their verl patch; torch's defaults otherwise): float16 RL fine-tuning with a scale that comes
back up quickly after a backoff.

References:
  Qi et al, `Defeating the Training-Inference Mismatch via FP16
  <https://arxiv.org/abs/2510.26788>`_, 2025.
"""

from __future__ import annotations

from lossscale_jax.compat import deepspeed, megatron, torch
from lossscale_jax.policies import LossScalePolicy

__all__ = ["deepspeed_fp16", "megatron_lm", "precision_rl", "torch_amp", "verl_megatron"]


def torch_amp() -> LossScalePolicy:
    """``torch.amp.GradScaler()``'s defaults: scale 2**16, doubled after 2000 good steps,
    halved on an overflow (``compat.torch.GradScaler``).

    Examples:
      >>> import lossscale_jax as lsj
      >>> float(lsj.presets.torch_amp().init().scale)
      65536.0
    """
    return torch.GradScaler()


def precision_rl() -> LossScalePolicy:
    """The scaler of Precision-RL (Qi et al. 2025) and verl's FSDP float16 actor: torch's rule
    with growth after 400 good steps (``ShardedGradScaler(growth_interval=400)``).

    Examples:
      >>> import lossscale_jax as lsj
      >>> policy = lsj.presets.precision_rl()
      >>> float(policy.init().scale), policy.growth_interval
      (65536.0, 400)
    """
    return torch.GradScaler(growth_interval=400)


def verl_megatron() -> LossScalePolicy:
    """verl's Megatron actor in float16: Megatron's rule from 2**15, floored at 1, doubled
    after 1000 good steps, halved after 2 overflows (``compat.megatron``).

    Examples:
      >>> import lossscale_jax as lsj
      >>> policy = lsj.presets.verl_megatron()
      >>> float(policy.init().scale), policy.hysteresis, policy.growth_interval
      (32768.0, 2, 1000)
    """
    return _megatron(2.0**15)


def megatron_lm() -> LossScalePolicy:
    """Megatron-LM's defaults (``--initial-loss-scale 2**32 --min-loss-scale 1
    --loss-scale-window 1000 --hysteresis 2``), Megatron's rule (``compat.megatron``).

    Examples:
      >>> import lossscale_jax as lsj
      >>> float(lsj.presets.megatron_lm().init().scale) == 2.0**32
      True
    """
    return _megatron(2.0**32)


def _megatron(initial_scale: float) -> LossScalePolicy:
    """Megatron's rule as Megatron-LM and verl configure it: from ``initial_scale``, floored
    at 1, doubled after 1000 good steps, halved after 2 overflows."""
    return megatron.DynamicGradScaler(
        initial_scale=initial_scale,
        min_scale=1.0,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=1000,
        hysteresis=2,
    )


def deepspeed_fp16() -> LossScalePolicy:
    """DeepSpeed's ``fp16`` defaults (``initial_scale_power=16, loss_scale_window=1000,
    hysteresis=2, min_loss_scale=1``), DeepSpeed's rule (``compat.deepspeed``).

    Examples:
      >>> import lossscale_jax as lsj
      >>> policy = lsj.presets.deepspeed_fp16()
      >>> float(policy.init().scale), policy.hysteresis
      (65536.0, 2)
    """
    return deepspeed.DynamicLossScaler(
        init_scale=2.0**16, scale_window=1000, min_scale=1.0, delayed_shift=2
    )
