"""The loss scalers of other frameworks, under their own names, step for step.

Each namespace below holds constructors named and parametrised like the
original; each returns a configured policy (for a scaler) or a configured
:func:`~lossscale_jax.loss_scaling` transformation (for an optimizer
wrapper). The docstrings name the source rule reproduced and where this
library's float32 state differs from it.

==============  ===========================================================
namespace       originals
==============  ===========================================================
``npu``         Huawei Ascend ``npu_bridge`` and TF1 ``contrib.mixed_precision``
``torch``       ``torch.amp.GradScaler``
``apex``        NVIDIA apex ``amp`` ``LossScaler``
``deepspeed``   DeepSpeed ``DynamicLossScaler``
``megatron``    Megatron-LM ``DynamicGradScaler`` / ``ConstantGradScaler``
``keras``       Keras 3 ``LossScaleOptimizer``
``cstorch``     Cerebras ``cstorch.amp.GradScaler`` / ``optimizer_step``
``mindspore``   MindSpore ``DynamicLossScaleManager`` / ``FixedLossScaleManager``
``jmp``         jmp ``DynamicLossScale`` / ``StaticLossScale`` / ``NoOpLossScale``
``flax``        Flax ``flax.training.dynamic_scale.DynamicScale``
==============  ===========================================================

Two deviations are shared and deliberate: the scale never becomes ``inf``
(a growth whose float32 result is not finite is refused, where Megatron,
MindSpore and Keras would store ``inf`` and never recover) and never drops
below float32's smallest normal number ``2**-126`` where the original has no
floor (torch, Keras, apex without ``min_loss_scale``: XLA flushes smaller
values to zero, and a zero scale trains nothing).
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lossscale_jax.policies import (
    DynamicScale,
    LossScalePolicy,
    NoScale,
    StaticScale,
    TolerantDynamicScale,
)
from lossscale_jax.transform import AxisName, loss_scaling

_TINY = float(np.finfo(np.float32).tiny)  # 2**-126, smallest normal float32
_F32_MAX = float(np.finfo(np.float32).max)
_INF = float("inf")

__all__ = [
    "apex",
    "cstorch",
    "deepspeed",
    "flax",
    "jmp",
    "keras",
    "megatron",
    "mindspore",
    "npu",
    "torch",
]


# --------------------------------------------------------------------------
# Helpers: argument checks under the original names.


def _number(name: str, value: Any) -> float:
    """``value`` as a Python float; accepts 0-d arrays (jmp passes ``jnp.asarray(2.**15)``)."""
    if isinstance(value, bool | str) or value is None:
        raise TypeError(f"{name} must be a real number, got {value!r}.")
    try:
        arr = np.asarray(value)
    except Exception as e:  # pragma: no cover - exotic objects
        raise TypeError(f"{name} must be a real number, got {value!r}.") from e
    if arr.shape != () or not np.issubdtype(arr.dtype, np.number) or np.iscomplexobj(arr):
        raise TypeError(f"{name} must be a real scalar, got {value!r}.")
    return float(arr)


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
    return int(value)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__}).")
    return bool(value)


def _build(cls: type, names: dict[str, str], **kwargs: Any) -> LossScalePolicy:
    """``cls(**kwargs)``, with errors worded in the original's argument names."""
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        message = str(e)
        for ours, theirs in names.items():
            message = re.sub(rf"\b{ours}\b", theirs, message)
        raise type(e)(message) from None


def _check_policy(name: str, value: Any) -> LossScalePolicy:
    if not isinstance(value, LossScalePolicy):
        raise TypeError(
            f"{name} must be a loss-scale manager built by lossscale_jax.compat "
            f"(a lossscale_jax policy), got {value!r}."
        )
    return value


class _Namespace:
    """A holder of constructors; not instantiable."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"compat.{cls.__name__} is a namespace; call its constructors, "
            f"e.g. compat.{cls.__name__}.{cls._example}(...)."
        )

    _example = ""


# --------------------------------------------------------------------------
# Huawei Ascend npu_bridge / TF1 contrib.mixed_precision.


class npu(_Namespace):
    """Huawei Ascend ``npu_bridge`` loss scaling (TF1 ``contrib.mixed_precision`` rules).

    ``npu_bridge.estimator.npu.npu_loss_scale_manager`` subclasses the TF1
    managers of ``tensorflow/contrib/mixed_precision/python/loss_scale_manager.py``
    and keeps their update rule; ``NPULossScaleOptimizer``
    (``npu_bridge/estimator/npu/npu_loss_scale_optimizer.py``) checks the
    device's float-status register and, when ``is_distributed``, all-reduces
    it so every device skips together.
    """

    _example = "ExponentialUpdateLossScaleManager"

    @staticmethod
    def FixedLossScaleManager(loss_scale: Any, enable_overflow_check: bool = True) -> StaticScale:
        """A fixed scale; with ``enable_overflow_check`` an overflowing step is skipped.

        Rule::

          scale = loss_scale                      # never changes
          skipped = overflow and enable_overflow_check

        Args:
          loss_scale: the scale, >= 1 (the original raises "loss scale must be
            at least 1").
          enable_overflow_check: skip overflowing steps (default True).

        Returns:
          A ``StaticScale``.

        Examples:
          >>> from lossscale_jax import compat
          >>> float(compat.npu.FixedLossScaleManager(1024).init().scale)
          1024.0
        """
        scale = _number("loss_scale", loss_scale)
        if not scale >= 1.0:
            raise ValueError(f"loss_scale must be at least 1, got {loss_scale!r}.")
        check = _bool("enable_overflow_check", enable_overflow_check)
        return _build(StaticScale, {"scale": "loss_scale"}, scale=scale, skip_on_overflow=check)

    @staticmethod
    def ExponentialUpdateLossScaleManager(
        init_loss_scale: Any,
        incr_every_n_steps: int,
        decr_every_n_nan_or_inf: int = 2,
        incr_ratio: float = 2,
        decr_ratio: float = 0.8,
    ) -> DynamicScale:
        """TF1's dynamic manager: good and bad steps counted until the scale changes.

        Rule (``update_loss_scale``, float32)::

          if finite:
              if good_steps + 1 >= incr_every_n_steps:
                  if isfinite(scale * incr_ratio): scale = scale * incr_ratio
                  good_steps = bad_steps = 0
              else:
                  good_steps += 1                 # bad_steps are kept
          else:
              if bad_steps + 1 >= decr_every_n_nan_or_inf:
                  scale = max(1, scale * decr_ratio)
                  good_steps = bad_steps = 0
              else:
                  bad_steps += 1; good_steps = 0

        This is ``DynamicScale(hysteresis=decr_every_n_nan_or_inf,
        consecutive_hysteresis=False, min_scale=1, max_scale=inf)``.

        Args:
          init_loss_scale: the starting scale (>= 1, the floor).
          incr_every_n_steps: good steps before a growth (int >= 1).
          decr_every_n_nan_or_inf: overflows (accumulated until the scale
            changes) before a backoff (int >= 1).
          incr_ratio: growth factor (> 1).
          decr_ratio: backoff factor in (0, 1).

        Returns:
          A ``DynamicScale``.

        Examples:
          >>> from lossscale_jax import compat
          >>> m = compat.npu.ExponentialUpdateLossScaleManager(2**32, 1000, decr_ratio=0.5)
          >>> m.hysteresis, m.consecutive_hysteresis, m.min_scale
          (2, False, 1.0)
        """
        names = {
            "init_scale": "init_loss_scale",
            "growth_interval": "incr_every_n_steps",
            "hysteresis": "decr_every_n_nan_or_inf",
            "growth_factor": "incr_ratio",
            "backoff_factor": "decr_ratio",
        }
        return _build(
            DynamicScale,
            names,
            init_scale=_number("init_loss_scale", init_loss_scale),
            growth_factor=_number("incr_ratio", incr_ratio),
            backoff_factor=_number("decr_ratio", decr_ratio),
            growth_interval=_int("incr_every_n_steps", incr_every_n_steps),
            hysteresis=_int("decr_every_n_nan_or_inf", decr_every_n_nan_or_inf),
            consecutive_hysteresis=False,
            min_scale=1.0,
            max_scale=_INF,
        )

    @staticmethod
    def NPULossScaleOptimizer(
        opt: optax.GradientTransformation,
        loss_scale_manager: LossScalePolicy,
        is_distributed: bool = False,
        *,
        axis_name: AxisName | None = None,
        overflow: str = "both",
    ) -> optax.GradientTransformationExtraArgs:
        """``opt`` with the manager's loss scaling and the NPU's saturating overflow check.

        Rule::

          overflow = any(|g| >= 65504 or not isfinite(g))   # float-status register
          if is_distributed: overflow = any(overflow over axis_name)
          scale = manager.update(overflow)
          if overflow: skip (opt's state, e.g. its step count, does not advance)
          else:        opt.update(g / scale)

        Saturation-mode devices write +-65504 instead of inf; the float-status
        register also flags invalid operations, hence ``overflow="both"``.

        Args:
          opt: the inner optax transformation.
          loss_scale_manager: ``npu.FixedLossScaleManager(...)`` or
            ``npu.ExponentialUpdateLossScaleManager(...)`` (any policy).
          is_distributed: reduce the overflow flag across devices (needs
            ``axis_name`` under ``pmap``/``shard_map``; under ``jit`` with
            sharded arrays the check is global already: leave it False).
          axis_name: the ``pmap``/``shard_map`` axis to reduce over.
          overflow: the overflow check, ``"both"`` by default.

        Returns:
          A ``loss_scaling`` transformation.

        Examples:
          >>> import optax
          >>> from lossscale_jax import compat
          >>> tx = compat.npu.NPULossScaleOptimizer(
          ...     optax.adam(1e-3),
          ...     compat.npu.ExponentialUpdateLossScaleManager(
          ...         init_loss_scale=2**32, incr_every_n_steps=1000,
          ...         decr_every_n_nan_or_inf=2, decr_ratio=0.5))
        """
        manager = _check_policy("loss_scale_manager", loss_scale_manager)
        distributed = _bool("is_distributed", is_distributed)
        if distributed and axis_name is None:
            raise ValueError(
                "is_distributed=True needs axis_name, the pmap/shard_map axis over which the "
                "overflow flag is reduced (under jit with sharded arrays the check is already "
                "global: use is_distributed=False)."
            )
        if not distributed and axis_name is not None:
            raise ValueError(f"axis_name={axis_name!r} is only used with is_distributed=True.")
        return loss_scaling(opt, manager, overflow=overflow, axis_name=axis_name)


# --------------------------------------------------------------------------
# PyTorch.


class torch(_Namespace):
    """PyTorch ``torch.amp.GradScaler`` (``torch/amp/grad_scaler.py``)."""

    _example = "GradScaler"

    @staticmethod
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
            raise ValueError(
                f"The growth factor must be > 1.0, got growth_factor={growth_factor!r}."
            )
        if not backoff < 1.0:
            raise ValueError(
                f"The backoff factor must be < 1.0, got backoff_factor={backoff_factor!r}."
            )
        return _build(
            DynamicScale,
            {},
            init_scale=_number("init_scale", init_scale),
            growth_factor=growth,
            backoff_factor=backoff,
            growth_interval=_int("growth_interval", growth_interval),
            min_scale=_TINY,
            max_scale=_INF,
        )


# --------------------------------------------------------------------------
# NVIDIA apex.


class apex(_Namespace):
    """NVIDIA apex ``amp`` loss scaling (``apex/amp/scaler.py``, ``LossScaler``)."""

    _example = "LossScaler"

    @staticmethod
    def LossScaler(
        loss_scale: Any = "dynamic",
        init_scale: float = 2.0**16,
        scale_window: int = 2000,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
    ) -> LossScalePolicy:
        """apex's ``LossScaler``: halve on overflow, double after ``scale_window`` good steps.

        Rule (``LossScaler.update_scale``)::

          if overflow and dynamic:
              scale = max(min_loss_scale, scale / 2) if min_loss_scale else scale / 2
              unskipped = 0                        # the step is skipped
          else:
              unskipped += 1
          if unskipped == scale_window and dynamic:
              scale = min(max_loss_scale, scale * 2); unskipped = 0

        The starting scale is ``min(max_loss_scale, init_scale)``. A numeric
        ``loss_scale`` is a static scale and apex never skips with it.
        Without ``min_loss_scale`` the scale stops at ``2**-126`` here.

        Args:
          loss_scale: ``"dynamic"`` or a number (static scale).
          init_scale: the starting dynamic scale.
          scale_window: good steps before a growth.
          min_loss_scale: floor (``None``: none).
          max_loss_scale: cap.

        Returns:
          A ``DynamicScale`` or a ``StaticScale(skip_on_overflow=False)``.

        Examples:
          >>> from lossscale_jax import compat
          >>> compat.apex.LossScaler().max_scale
          16777216.0
        """
        names = {
            "init_scale": "init_scale",
            "growth_interval": "scale_window",
            "min_scale": "min_loss_scale",
            "max_scale": "max_loss_scale",
        }
        if isinstance(loss_scale, str):
            if loss_scale != "dynamic":
                raise ValueError(f"loss_scale must be 'dynamic' or a number, got {loss_scale!r}.")
        else:
            return _build(
                StaticScale,
                {"scale": "loss_scale"},
                scale=_number("loss_scale", loss_scale),
                skip_on_overflow=False,
            )
        hi = _number("max_loss_scale", max_loss_scale)
        lo = _TINY if not min_loss_scale else _number("min_loss_scale", min_loss_scale)
        return _build(
            DynamicScale,
            names,
            init_scale=min(hi, _number("init_scale", init_scale)),
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=_int("scale_window", scale_window),
            min_scale=lo,
            max_scale=hi,
        )


# --------------------------------------------------------------------------
# DeepSpeed.


class deepspeed(_Namespace):
    """DeepSpeed (``deepspeed/runtime/fp16/loss_scaler.py``, ``DynamicLossScaler``)."""

    _example = "DynamicLossScaler"

    @staticmethod
    def DynamicLossScaler(
        init_scale: float = 2.0**32,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1,
        delayed_shift: int = 1,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
    ) -> DynamicScale:
        """DeepSpeed's dynamic scaler with delayed shift (hysteresis).

        Rule (``DynamicLossScaler.update_scale``)::

          if overflow:
              if delayed_shift == 1 or cur_hysteresis == 1:
                  if scale == min_scale and raise_error_at_min_scale: raise
                  scale = max(scale / scale_factor, min_scale)
              else:
                  cur_hysteresis -= 1
              last_overflow_iter = cur_iter
          else:
              if consecutive_hysteresis: cur_hysteresis = delayed_shift
              if (cur_iter - last_overflow_iter) % scale_window == 0:
                  if not consecutive_hysteresis: cur_hysteresis = delayed_shift
                  scale *= scale_factor
          cur_iter += 1

        ``cur_hysteresis`` is not restored by a backoff: once it reaches 1
        every overflow backs off until a growth (or, with
        ``consecutive_hysteresis``, a good step) restores it. That is
        ``DynamicScale(hysteresis=delayed_shift, sticky_hysteresis=True)``.

        The raise: under ``jit`` no exception can leave the step. The step
        DeepSpeed raises at is the step with ``metrics(opt_state)["stuck"]``
        True; it is skipped like any overflow and the state stays valid. Pass
        ``on_stuck="error"`` to ``loss_scaling`` to turn it into a ``checkify``
        error (``raise_error_at_min_scale=True``) or leave ``on_stuck="skip"``
        (``False``: DeepSpeed goes on skipping too).

        DeepSpeed keeps the scale in a Python float; here it is float32, so
        trajectories agree exactly for power-of-two ``scale_factor`` (the
        default 2) and the scale is not grown past float32's range.

        Args:
          init_scale, scale_factor, scale_window, min_scale, delayed_shift, consecutive_hysteresis:
            as in DeepSpeed.
          raise_error_at_min_scale: see above: it chooses the ``on_stuck`` to
            pass to ``loss_scaling`` (``"error"`` for True); the policy reports
            ``stuck`` either way.

        Returns:
          A ``DynamicScale``.

        Examples:
          >>> from lossscale_jax import compat
          >>> p = compat.deepspeed.DynamicLossScaler(delayed_shift=2)
          >>> p.hysteresis, p.sticky_hysteresis
          (2, True)
        """
        _bool("raise_error_at_min_scale", raise_error_at_min_scale)
        factor = _number("scale_factor", scale_factor)
        if not factor > 1.0:
            raise ValueError(f"scale_factor must be > 1, got {scale_factor!r}.")
        names = {
            "growth_interval": "scale_window",
            "hysteresis": "delayed_shift",
            "growth_factor": "scale_factor",
        }
        return _build(
            DynamicScale,
            names,
            init_scale=_number("init_scale", init_scale),
            growth_factor=factor,
            backoff_factor=1.0 / factor,
            growth_interval=_int("scale_window", scale_window),
            hysteresis=_int("delayed_shift", delayed_shift),
            consecutive_hysteresis=_bool("consecutive_hysteresis", consecutive_hysteresis),
            min_scale=_number("min_scale", min_scale),
            max_scale=_INF,
            sticky_hysteresis=True,
        )


# --------------------------------------------------------------------------
# Megatron-LM.


class megatron(_Namespace):
    """Megatron-LM (``megatron/core/optimizer/grad_scaler.py``)."""

    _example = "DynamicGradScaler"

    @staticmethod
    def DynamicGradScaler(
        initial_scale: float,
        min_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
    ) -> DynamicScale:
        """Megatron's dynamic scaler; its hysteresis tracker is reset only by a growth.

        Rule (``DynamicGradScaler.update``, float32 tensors)::

          if found_inf:
              growth_tracker = 0
              hysteresis_tracker -= 1
              if hysteresis_tracker <= 0:
                  scale = max(scale * backoff_factor, min_scale)
          else:
              growth_tracker += 1
              if growth_tracker == growth_interval:
                  growth_tracker = 0; hysteresis_tracker = hysteresis
                  scale = scale * growth_factor

        After ``hysteresis`` overflows every further overflow backs off until
        the next growth: ``DynamicScale(consecutive_hysteresis=False,
        sticky_hysteresis=True)``. Megatron would let a growth overflow to
        ``inf``; here it is refused.

        Args:
          initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis:
            as in Megatron (all required there).

        Returns:
          A ``DynamicScale``.

        Examples:
          >>> from lossscale_jax import compat
          >>> p = compat.megatron.DynamicGradScaler(2.0**32, 1.0, 2.0, 0.5, 1000, 2)
          >>> p.sticky_hysteresis, p.consecutive_hysteresis
          (True, False)
        """
        lo = _number("min_scale", min_scale)
        init = _number("initial_scale", initial_scale)
        if not lo > 0.0:
            raise ValueError(f"min_scale must be > 0, got {min_scale!r}.")
        if not lo <= init:
            raise ValueError(
                f"min_scale ({min_scale!r}) must be <= initial_scale ({initial_scale!r})."
            )
        return _build(
            DynamicScale,
            {"init_scale": "initial_scale"},
            init_scale=init,
            growth_factor=_number("growth_factor", growth_factor),
            backoff_factor=_number("backoff_factor", backoff_factor),
            growth_interval=_int("growth_interval", growth_interval),
            hysteresis=_int("hysteresis", hysteresis),
            consecutive_hysteresis=False,
            min_scale=lo,
            max_scale=_INF,
            sticky_hysteresis=True,
        )

    @staticmethod
    def ConstantGradScaler(initial_scale: float) -> StaticScale:
        """Megatron's constant scaler: the scale never changes; overflowing steps are skipped.

        Examples:
          >>> from lossscale_jax import compat
          >>> float(compat.megatron.ConstantGradScaler(4096.0).init().scale)
          4096.0
        """
        return _build(
            StaticScale, {"scale": "initial_scale"}, scale=_number("initial_scale", initial_scale)
        )


# --------------------------------------------------------------------------
# Keras 3.


class keras(_Namespace):
    """Keras 3 (``keras/src/optimizers/loss_scale_optimizer.py``)."""

    _example = "LossScaleOptimizer"

    @staticmethod
    def LossScaleOptimizer(
        inner_optimizer: optax.GradientTransformation,
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
    ) -> optax.GradientTransformationExtraArgs:
        """Keras 3's ``LossScaleOptimizer``: skip and halve on inf/nan, double after N good steps.

        Rule (``stateless_apply``)::

          if all(isfinite(grads)):
              if step_counter == dynamic_growth_steps - 1:
                  scale = scale * 2; step_counter = 0
              else:
                  step_counter += 1
              inner.apply(grads / scale)
          else:
              scale = scale / 2; step_counter = 0     # the step is skipped

        Keras has no bounds (its scale can reach 0 or inf); here it stays in
        ``[2**-126, float32 max]``.

        Args:
          inner_optimizer: the inner optax transformation.
          initial_scale: the starting scale.
          dynamic_growth_steps: good steps before a growth.

        Returns:
          A ``loss_scaling`` transformation (``overflow="ieee"``).

        Examples:
          >>> import optax
          >>> from lossscale_jax import compat
          >>> tx = compat.keras.LossScaleOptimizer(optax.sgd(0.1))
        """
        policy = _build(
            DynamicScale,
            {"init_scale": "initial_scale", "growth_interval": "dynamic_growth_steps"},
            init_scale=_number("initial_scale", initial_scale),
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=_int("dynamic_growth_steps", dynamic_growth_steps),
            min_scale=_TINY,
            max_scale=_INF,
        )
        return loss_scaling(inner_optimizer, policy, overflow="ieee")


# --------------------------------------------------------------------------
# Cerebras.


def _cerebras_clip(max_gradient_norm: float) -> optax.GradientTransformation:
    """``torch.nn.utils.clip_grad_norm_`` as Cerebras uses it: ``g * min(1, m / (norm + 1e-6))``."""

    def update_fn(updates, state, params=None):
        del params
        leaves = [
            g
            for g in jax.tree_util.tree_leaves(updates)
            if jnp.issubdtype(jnp.asarray(g).dtype, jnp.floating)
        ]
        sq = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves)
        norm = jnp.sqrt(jnp.asarray(sq, jnp.float32))
        coef = jnp.float32(max_gradient_norm) / (norm + jnp.float32(1e-6))
        coef = jnp.minimum(coef, jnp.float32(1.0))
        clipped = jax.tree_util.tree_map(
            lambda g: (g * coef).astype(g.dtype) if jnp.issubdtype(g.dtype, jnp.floating) else g,
            updates,
        )
        return clipped, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


class cstorch(_Namespace):
    """Cerebras ``cerebras.pytorch.amp`` (``cerebras/pytorch/amp/grad_scaler.py``)."""

    _example = "GradScaler"

    @staticmethod
    def GradScaler(
        loss_scale: Any = None,
        init_scale: float | None = None,
        steps_per_increase: int | None = None,
        min_loss_scale: float | None = None,
        max_loss_scale: float | None = None,
        overflow_tolerance: float = 0.0,
        max_gradient_norm: float | None = None,
        *,
        half_dtype: str = "float16",
    ) -> LossScalePolicy:
        """Cerebras's ``GradScaler``: back off when the overflow rate exceeds a tolerance.

        Rule (``GradScaler.update_scale``; counters since the last rescale)::

          steps += 1; overflows += not isfinite
          if overflows / steps > overflow_tolerance:   # float32
              scale /= 2; steps = overflows = 0
          if steps > steps_per_increase:
              scale *= 2; steps = overflows = 0
          scale = clip(scale, min_loss_scale, max_loss_scale)

        Every non-finite step is skipped (``step_if_finite``). Defaults as in
        Cerebras (an unset or zero argument takes its default):
        ``init_scale = max_loss_scale = 2**15`` (``2**31`` for
        ``half_dtype="cbfloat16"``), ``steps_per_increase=2000``,
        ``min_loss_scale=2**-14``. A numeric ``loss_scale`` is static and
        never skips. This is ``TolerantDynamicScale(growth_interval=
        steps_per_increase + 1)`` started at ``min(max_loss_scale, init_scale)``.

        ``max_gradient_norm`` (deprecated in Cerebras in favour of clipping in
        ``optimizer_step``) cannot live in a policy: pass it to
        ``cstorch.optimizer_step``, which clips in the same step.

        Returns:
          A ``TolerantDynamicScale`` or ``StaticScale(skip_on_overflow=False)``.

        Examples:
          >>> from lossscale_jax import compat
          >>> p = compat.cstorch.GradScaler(loss_scale="dynamic", overflow_tolerance=0.05)
          >>> p.growth_interval, p.min_scale, p.max_scale
          (2001, 6.103515625e-05, 32768.0)
        """
        if half_dtype not in ("float16", "bfloat16", "cbfloat16"):
            raise ValueError(
                f"half_dtype must be 'float16', 'bfloat16' or 'cbfloat16', got {half_dtype!r}."
            )
        if max_gradient_norm is not None:
            raise ValueError(
                "max_gradient_norm: a loss-scale policy does not clip; pass max_gradient_norm "
                "to compat.cstorch.optimizer_step(optimizer, grad_scaler, max_gradient_norm=...)."
            )
        default_max = 2.0**31 if half_dtype == "cbfloat16" else 2.0**15
        loss_scale = loss_scale if loss_scale else 1.0
        if isinstance(loss_scale, str):
            if loss_scale != "dynamic":
                raise ValueError(f"loss_scale must be 'dynamic' or a number, got {loss_scale!r}.")
        else:
            return _build(
                StaticScale,
                {"scale": "loss_scale"},
                scale=_number("loss_scale", loss_scale),
                skip_on_overflow=False,
            )
        init = _number("init_scale", init_scale) if init_scale else default_max
        steps = _int("steps_per_increase", steps_per_increase) if steps_per_increase else 2000
        lo = _number("min_loss_scale", min_loss_scale) if min_loss_scale else 2.0**-14
        hi = _number("max_loss_scale", max_loss_scale) if max_loss_scale else default_max
        if lo < 2.0**-14:
            raise ValueError(
                f"min_loss_scale too small: must be >= 2**-14, got {min_loss_scale!r}."
            )
        tol = _number("overflow_tolerance", overflow_tolerance)
        if tol < 0:
            raise ValueError(
                f"overflow_tolerance (the loss scaling counter threshold) must be >= 0, "
                f"got {overflow_tolerance!r}."
            )
        names = {
            "init_scale": "init_scale",
            "min_scale": "min_loss_scale",
            "max_scale": "max_loss_scale",
            "growth_interval": "steps_per_increase",
        }
        return _build(
            TolerantDynamicScale,
            names,
            init_scale=min(hi, init),
            growth_interval=steps + 1,
            overflow_tolerance=min(tol, 1.0),
            min_scale=lo,
            max_scale=hi,
        )

    @staticmethod
    def optimizer_step(
        optimizer: optax.GradientTransformation,
        grad_scaler: LossScalePolicy,
        max_gradient_norm: float | None = None,
        max_gradient_value: float | None = None,
        *,
        overflow: str = "ieee",
        axis_name: AxisName | None = None,
    ) -> optax.GradientTransformationExtraArgs:
        """Cerebras's ``optimizer_step``: unscale, clip, skip non-finite steps, update the scale.

        Rule (``cerebras/pytorch/amp/optimizer_step.py``)::

          g = g / scale
          if max_gradient_norm: g = g * min(1, max_gradient_norm / (norm(g) + 1e-6))
          elif max_gradient_value: g = clip(g, -max_gradient_value, max_gradient_value)
          if finite: optimizer.step(g)              # else skipped
          grad_scaler.update()

        The clip runs inside the good branch, on the unscaled gradients.

        Args:
          optimizer: the inner optax transformation.
          grad_scaler: ``cstorch.GradScaler(...)`` (any policy).
          max_gradient_norm: global-norm clipping threshold (>= 0) or None.
          max_gradient_value: value clipping threshold (>= 0) or None; not
            both.
          overflow: the overflow check (default ``"ieee"``).
          axis_name: ``pmap``/``shard_map`` axis for the overflow reduction.

        Returns:
          A ``loss_scaling`` transformation.

        Examples:
          >>> import optax
          >>> from lossscale_jax import compat
          >>> tx = compat.cstorch.optimizer_step(
          ...     optax.adamw(1e-4), compat.cstorch.GradScaler(loss_scale="dynamic"),
          ...     max_gradient_norm=1.0)
        """
        policy = _check_policy("grad_scaler", grad_scaler)
        if max_gradient_norm is not None and max_gradient_value is not None:
            raise ValueError(
                f"Gradients can be clipped by norm(={max_gradient_norm}) or by "
                f"value(={max_gradient_value}), but not both."
            )
        inner = optimizer
        if max_gradient_norm is not None:
            norm = _number("max_gradient_norm", max_gradient_norm)
            if not (math.isfinite(norm) and norm >= 0.0):
                raise ValueError(
                    f"max_gradient_norm has to be a non-negative float, got {max_gradient_norm!r}."
                )
            inner = optax.chain(_cerebras_clip(norm), optimizer)
        elif max_gradient_value is not None:
            value = _number("max_gradient_value", max_gradient_value)
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(
                    f"max_gradient_value has to be a non-negative float, got "
                    f"{max_gradient_value!r}."
                )
            inner = optax.chain(optax.clip(value), optimizer)
        return loss_scaling(inner, policy, overflow=overflow, axis_name=axis_name)


# --------------------------------------------------------------------------
# MindSpore.


class mindspore(_Namespace):
    """MindSpore (``mindspore/train/loss_scale_manager.py``, ``nn/wrap/loss_scale.py``)."""

    _example = "DynamicLossScaleManager"

    @staticmethod
    def DynamicLossScaleManager(
        init_loss_scale: float = 2**24,
        scale_factor: float = 2,
        scale_window: int = 2000,
    ) -> DynamicScale:
        """MindSpore's dynamic manager (its ``DynamicLossScaleUpdateCell``).

        Rule (``DynamicLossScaleUpdateCell.construct``, float32)::

          if overflow:
              scale = max(scale * reciprocal(scale_factor), 1)
          should_inc = cur_iter - last_overflow_iter >= scale_window
          if overflow or should_inc: last_overflow_iter = cur_iter
          if should_inc and not overflow: scale = scale * scale_factor
          cur_iter += 1

        A growth after ``scale_window`` good steps, a floor of 1. MindSpore
        would let a growth overflow to ``inf``; here it is refused.

        Args:
          init_loss_scale: the starting scale (>= 1).
          scale_factor: growth factor; backoff multiplies by its float32
            reciprocal.
          scale_window: good steps before a growth (int >= 1).

        Returns:
          A ``DynamicScale``.

        Examples:
          >>> from lossscale_jax import compat
          >>> float(compat.mindspore.DynamicLossScaleManager().init().scale)
          16777216.0
        """
        init = _number("init_loss_scale", init_loss_scale)
        if init < 1.0:
            raise ValueError(f"init_loss_scale must be >= 1, got {init_loss_scale!r}.")
        window = _int("scale_window", scale_window)
        if window <= 0:
            raise ValueError(f"scale_window must be a positive int, got {scale_window!r}.")
        factor = _number("scale_factor", scale_factor)
        if factor <= 0:
            raise ValueError(f"scale_factor must be > 0, got {scale_factor!r}.")
        if not factor > 1.0:
            raise ValueError(
                f"scale_factor must be > 1 for the scale to grow and shrink, got {scale_factor!r}."
            )
        reciprocal = float(np.float32(1.0) / np.float32(factor))
        return _build(
            DynamicScale,
            {"init_scale": "init_loss_scale", "growth_interval": "scale_window"},
            init_scale=init,
            growth_factor=factor,
            backoff_factor=reciprocal,
            growth_interval=window,
            min_scale=1.0,
            max_scale=_INF,
        )

    @staticmethod
    def FixedLossScaleManager(
        loss_scale: float = 128.0, drop_overflow_update: bool = True
    ) -> StaticScale:
        """MindSpore's fixed manager: a fixed scale; overflowing steps dropped if asked.

        Rule::

          scale = loss_scale
          skipped = overflow and drop_overflow_update

        Examples:
          >>> from lossscale_jax import compat
          >>> compat.mindspore.FixedLossScaleManager(1024, False).skip_on_overflow
          False
        """
        scale = _number("loss_scale", loss_scale)
        if scale < 1.0:
            raise ValueError(f"loss_scale must be >= 1, got {loss_scale!r}.")
        return _build(
            StaticScale,
            {"scale": "loss_scale"},
            scale=scale,
            skip_on_overflow=_bool("drop_overflow_update", drop_overflow_update),
        )


# --------------------------------------------------------------------------
# jmp.


class jmp(_Namespace):
    """DeepMind jmp (``jmp/_src/loss_scale.py``)."""

    _example = "DynamicLossScale"

    @staticmethod
    def DynamicLossScale(
        loss_scale: Any,
        period: int = 2000,
        factor: int = 2,
        min_loss_scale: Any = 1.0,
    ) -> DynamicScale:
        """jmp's ``DynamicLossScale``.

        Rule (``DynamicLossScale.adjust``)::

          if grads_finite:
              if counter == period - 1:
                  loss_scale = first_finite(loss_scale * factor, loss_scale)
              counter = (counter + 1) % period
          else:
              loss_scale = max(min_loss_scale, loss_scale / factor); counter = 0

        Unlike jmp, ``min_loss_scale`` survives ``jit`` (jmp's pytree
        flattening drops it and falls back to 1). jmp divides by ``factor``;
        here the scale is multiplied by ``1 / factor``, the same float32
        number for power-of-two factors (the default 2).

        Examples:
          >>> import jax.numpy as jnp
          >>> from lossscale_jax import compat
          >>> compat.jmp.DynamicLossScale(jnp.asarray(2.0**15), period=100).growth_interval
          100
        """
        f = _number("factor", factor)
        if not f > 1.0:
            raise ValueError(f"factor must be > 1, got {factor!r}.")
        return _build(
            DynamicScale,
            {
                "init_scale": "loss_scale",
                "growth_interval": "period",
                "min_scale": "min_loss_scale",
                "growth_factor": "factor",
            },
            init_scale=_number("loss_scale", loss_scale),
            growth_factor=f,
            backoff_factor=1.0 / f,
            growth_interval=_int("period", period),
            min_scale=_number("min_loss_scale", min_loss_scale),
            max_scale=_INF,
        )

    @staticmethod
    def StaticLossScale(loss_scale: Any) -> StaticScale:
        """jmp's ``StaticLossScale``: a fixed scale (overflowing steps are skipped).

        Examples:
          >>> from lossscale_jax import compat
          >>> float(compat.jmp.StaticLossScale(128.0).init().scale)
          128.0
        """
        return _build(StaticScale, {"scale": "loss_scale"}, scale=_number("loss_scale", loss_scale))

    @staticmethod
    def NoOpLossScale() -> NoScale:
        """jmp's ``NoOpLossScale``: no scaling.

        Examples:
          >>> from lossscale_jax import compat
          >>> float(compat.jmp.NoOpLossScale().init().scale)
          1.0
        """
        return NoScale()


# --------------------------------------------------------------------------
# Flax.


class flax(_Namespace):
    """Flax (``flax/training/dynamic_scale.py``)."""

    _example = "DynamicScale"

    @staticmethod
    def DynamicScale(
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        scale: float = 65536.0,
        minimum_scale: float | None = _TINY,
    ) -> DynamicScale:
        """Flax's ``DynamicScale``; it grows one step later than the others.

        Rule (``DynamicScale.value_and_grad``)::

          grow = fin_steps == growth_interval
          if finite:
              if grow: scale = min(scale * growth_factor, float32 max)
          else:
              scale = max(scale * backoff_factor, minimum_scale)
          fin_steps = 0 if grow or not finite else fin_steps + 1

        The growth comes on the ``growth_interval + 1``-th good step, so this
        is ``DynamicScale(growth_interval=growth_interval + 1)``, and a growth
        past float32 clamps to its largest number (``growth_overflow="clamp"``).
        ``minimum_scale=None`` (no floor) stops at ``2**-126`` here.

        Examples:
          >>> from lossscale_jax import compat
          >>> compat.flax.DynamicScale(growth_interval=10).growth_interval
          11
        """
        interval = _int("growth_interval", growth_interval)
        if interval < 0:
            raise ValueError(f"growth_interval must be >= 0, got {growth_interval!r}.")
        lo = _TINY if minimum_scale is None else _number("minimum_scale", minimum_scale)
        return _build(
            DynamicScale,
            {"init_scale": "scale", "min_scale": "minimum_scale"},
            init_scale=_number("scale", scale),
            growth_factor=_number("growth_factor", growth_factor),
            backoff_factor=_number("backoff_factor", backoff_factor),
            growth_interval=interval + 1,
            min_scale=lo,
            max_scale=_F32_MAX,
            growth_overflow="clamp",
        )
