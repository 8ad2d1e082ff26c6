"""The loss scalers of other frameworks, under their own names, step for step.

One module per framework (``compat/deepspeed.py`` holds DeepSpeed's rules)
holds constructors named and parametrised like the original; each returns a
configured policy (for a scaler) or a configured
:func:`~lossscale_jax.loss_scaling` transformation (for an optimizer
wrapper). The docstrings name the source rule reproduced and where this
library's float32 state differs from it.

==============  ===========================================================
module          originals
==============  ===========================================================
``npu``         Huawei Ascend ``npu_bridge`` and TF1 ``contrib.mixed_precision``
``torch``       ``torch.amp.GradScaler`` (one or several optimizers)
``apex``        NVIDIA apex ``amp`` ``LossScaler``, ``update_scale_hysteresis``
``deepspeed``   DeepSpeed ``DynamicLossScaler`` (ZeRO), ``FP16_Optimizer``,
                ``FP16_UnfusedOptimizer`` (fp16 without ZeRO)
``megatron``    Megatron-LM ``DynamicGradScaler`` / ``ConstantGradScaler``
``keras``       Keras 3 ``LossScaleOptimizer``
``cstorch``     Cerebras ``cstorch.amp.GradScaler`` / ``optimizer_step``
``mindspore``   MindSpore ``DynamicLossScaleManager`` / ``FixedLossScaleManager``
``jmp``         jmp ``DynamicLossScale`` / ``StaticLossScale`` / ``NoOpLossScale``
``mpx``         mpx (``mixed-precision-for-jax``, for Equinox) ``DynamicLossScaling``,
                ``filter_value_and_grad``, ``optimizer_update``
``flax``        Flax ``flax.training.dynamic_scale.DynamicScale``
``fairseq``     fairseq ``DynamicLossScaler`` (its FP16 optimizers' scaler)
``metaseq``     metaseq ``DynamicLossScaler`` (OPT's; the window follows the scale)
``colossalai``  Colossal-AI ``DynamicGradScaler``
``paddle``      PaddlePaddle ``paddle.amp.GradScaler``, the ``update_loss_scaling`` op
==============  ===========================================================

Runs already training elsewhere come across with ``import_state`` (torch,
DeepSpeed, Megatron, Keras, jmp, mpx, Flax, fairseq, metaseq, Colossal-AI,
Paddle;
DeepSpeed's fp16 optimizers: ``import_fp16_optimizer_state``), which
returns ``(policy, LossScaleState)`` from what the original saves, and
``lossscale_jax.set_loss_scale_state``, which puts the state into a fresh
optimizer state; ``export_state`` goes the other way.

Two deviations are shared and deliberate: the scale never becomes ``inf``
(a growth whose float32 result is not finite is refused, where Megatron,
MindSpore and Keras would store ``inf`` and never recover) and never drops
below float32's smallest normal number ``2**-126`` where the original has no
floor (torch, Keras, apex without ``min_loss_scale``: XLA flushes smaller
values to zero, and a zero scale trains nothing).

``mpx`` loads Equinox, which the rest of the package does not need: it is imported on
first use (``compat.mpx``, or ``from lossscale_jax.compat import mpx``).

Holds: one public module per framework (the table above) and the private modules they
share or outgrow: ``_common`` (the argument checks, worded in the originals' names),
``_deepspeed_fp16`` (DeepSpeed's fp16 optimizers without ZeRO), ``_fairseq_scale``
(fairseq's and metaseq's rule as one policy), ``_flax_scale`` (the Flax-shaped
``DynamicScale``), ``_jmp_policy`` and ``_jmp_scale`` (jmp's precision policies and loss-scale
objects), ``_mpx_cast``, ``_mpx_grad`` and ``_mpx_scale`` (mpx's casts, gradient tools and
loss scale) and ``_torch_multi`` (``torch.multi_optimizer``).

May import: everything else in the package (it is the top of the order: ``engine``,
``policies``, ``taps``, ``access``, the front-end modules, ``layerwise``, ``diagnosis``,
``checkpoint``) and ``errors``. Nothing in the package imports it but ``lossscale_jax``'s
``__init__``, on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lossscale_jax.compat import (
    apex,
    colossalai,
    cstorch,
    deepspeed,
    fairseq,
    flax,
    jmp,
    keras,
    megatron,
    metaseq,
    mindspore,
    npu,
    paddle,
    torch,
)

if TYPE_CHECKING:
    from lossscale_jax.compat import mpx


def __getattr__(name: str) -> Any:
    if name == "mpx":
        module = importlib.import_module("lossscale_jax.compat.mpx")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'lossscale_jax.compat' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"mpx"})


__all__ = [
    "apex",
    "colossalai",
    "cstorch",
    "deepspeed",
    "fairseq",
    "flax",
    "jmp",
    "keras",
    "megatron",
    "metaseq",
    "mindspore",
    "mpx",
    "npu",
    "paddle",
    "torch",
]
