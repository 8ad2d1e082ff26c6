"""Other frameworks' loss-scale update rules, transcribed from their sources into plain Python.

Each class keeps the original's state (and its number type: float32 where the
original holds a float32 tensor, Python floats where it holds a Python float)
and exposes ``step(overflow) -> (scale, skipped)``. These frameworks are not
test dependencies (torch alone is gigabytes, the rest need their devices), so
the rules are transcribed; the source file of each is named on its class.
"""

from __future__ import annotations

import math

import numpy as np

F32 = np.float32


def f32(x: float) -> np.float32:
    with np.errstate(over="ignore"):
        return F32(x)


class TF1ExponentialUpdate:
    """tensorflow/contrib/mixed_precision/python/loss_scale_manager.py,
    ``ExponentialUpdateLossScaleManager.update_loss_scale``; with ``npu_bridge=True`` the override
    in npu_bridge/estimator/npu/npu_loss_scale_manager.py, which grows only while
    ``loss_scale < (3.4e+38) / incr_ratio`` (a Python float, compared in float32) instead of
    while ``is_finite(loss_scale * incr_ratio)``.
    """

    def __init__(
        self,
        init_loss_scale,
        incr_every_n_steps,
        decr_every_n_nan_or_inf=2,
        incr_ratio=2,
        decr_ratio=0.8,
        npu_bridge=False,
    ):
        self.npu_limit = F32(3.4e38 / incr_ratio) if npu_bridge else None
        self.loss_scale = F32(init_loss_scale)
        self.incr_every_n_steps = incr_every_n_steps
        self.decr_every_n_nan_or_inf = decr_every_n_nan_or_inf
        self.incr_ratio = F32(incr_ratio)
        self.decr_ratio = F32(decr_ratio)
        self.num_good_steps = 0
        self.num_bad_steps = 0

    def step(self, overflow: bool):
        if not overflow:
            if self.num_good_steps + 1 >= self.incr_every_n_steps:
                with np.errstate(over="ignore"):
                    new = F32(self.loss_scale * self.incr_ratio)
                if self.npu_limit is not None:
                    grows = self.loss_scale < self.npu_limit
                else:
                    grows = np.isfinite(new)
                if grows:
                    self.loss_scale = new
                self.num_good_steps = self.num_bad_steps = 0  # _reset_stats
            else:
                self.num_good_steps += 1
        else:
            if self.num_bad_steps + 1 >= self.decr_every_n_nan_or_inf:
                self.loss_scale = max(F32(1.0), F32(self.loss_scale * self.decr_ratio))
                self.num_good_steps = self.num_bad_steps = 0
            else:
                self.num_bad_steps += 1
                self.num_good_steps = 0
        # NPULossScaleOptimizer / contrib LossScaleOptimizer: apply only if finite.
        return self.loss_scale, overflow


class TorchGradScaler:
    """torch/amp/grad_scaler.py ``GradScaler.update`` ->
    aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp ``_amp_update_scale_cpu_kernel``
    (same rule as ``amp_update_scale_cuda_kernel`` in aten/src/ATen/native/cuda/AmpKernels.cu):
    a float32 scale multiplied by double factors.
    """

    def __init__(
        self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000
    ):
        self.scale = F32(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.growth_tracker = 0

    def step(self, found_inf: bool):
        if found_inf:
            self.scale = f32(float(self.scale) * self.backoff_factor)
            self.growth_tracker = 0
        else:
            successful = self.growth_tracker + 1
            if successful == self.growth_interval:
                new_scale = f32(float(self.scale) * self.growth_factor)
                if np.isfinite(new_scale):
                    self.scale = new_scale
                self.growth_tracker = 0
            else:
                self.growth_tracker = successful
        # GradScaler.step skips optimizer.step when found_inf.
        return self.scale, found_inf


class ApexLossScaler:
    """apex/amp/scaler.py, ``LossScaler.__init__`` and ``update_scale`` (Python floats)."""

    def __init__(
        self,
        loss_scale="dynamic",
        init_scale=2.0**16,
        scale_window=2000,
        min_loss_scale=None,
        max_loss_scale=2.0**24,
    ):
        if loss_scale == "dynamic":
            self.dynamic = True
            self._loss_scale = min(max_loss_scale, init_scale)
        else:
            self.dynamic = False
            self._loss_scale = loss_scale
        self._max_loss_scale = max_loss_scale
        self._min_loss_scale = min_loss_scale
        self._scale_seq_len = scale_window
        self._unskipped = 0

    def step(self, has_overflow: bool):
        if has_overflow and self.dynamic:
            should_skip = True
            if self._min_loss_scale:
                self._loss_scale = max(self._min_loss_scale, self._loss_scale / 2.0)
            else:
                self._loss_scale = self._loss_scale / 2.0
            self._unskipped = 0
        else:
            should_skip = False
            self._unskipped += 1
        if self._unskipped == self._scale_seq_len and self.dynamic:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * 2.0)
            self._unskipped = 0
        return self._loss_scale, should_skip


class DeepSpeedMinScaleError(Exception):
    """DeepSpeed's "Current loss scale already at minimum" exception."""


class DeepSpeedDynamicLossScaler:
    """deepspeed/runtime/fp16/loss_scaler.py, ``DynamicLossScaler.update_scale`` (Python floats)."""

    def __init__(
        self,
        init_scale=2**32,
        scale_factor=2.0,
        scale_window=1000,
        min_scale=1,
        delayed_shift=1,
        consecutive_hysteresis=False,
        raise_error_at_min_scale=True,
    ):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale

    def would_raise(self, overflow: bool) -> bool:
        """Whether this step meets the raise condition (whatever raise_error_at_min_scale says)."""
        return bool(
            overflow
            and (self.delayed_shift == 1 or self.cur_hysteresis == 1)
            and self.cur_scale == self.min_scale
        )

    def step(self, overflow: bool):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if (self.cur_scale == self.min_scale) and self.raise_error_at_min_scale:
                    raise DeepSpeedMinScaleError(
                        "Current loss scale already at minimum - cannot decrease scale anymore."
                    )
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1
        # The fp16 optimizers skip the step on overflow.
        return self.cur_scale, overflow


class MegatronDynamicGradScaler:
    """megatron/core/optimizer/grad_scaler.py, ``DynamicGradScaler.update`` (float32 tensors)."""

    def __init__(
        self, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis
    ):
        self._scale = F32(initial_scale)
        self.min_scale = F32(min_scale)
        self.growth_factor = F32(growth_factor)
        self.backoff_factor = F32(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def step(self, found_inf: bool):
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(F32(self._scale * self.backoff_factor), self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                with np.errstate(over="ignore"):
                    self._scale = F32(self._scale * self.growth_factor)
        # MegatronOptimizer.step returns without stepping when found_inf.
        return self._scale, found_inf

    def state_dict(self):
        """``DynamicGradScaler.state_dict`` (the scale a float32 tensor of shape (1,))."""
        return {
            "scale": np.asarray([self._scale], np.float32),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }


class DeepSpeedFP16Optimizer:
    """deepspeed/runtime/fp16/fused_optimizer.py (``FP16_Optimizer``) and unfused_optimizer.py
    (``FP16_UnfusedOptimizer``): ``__init__``'s dynamic branch, ``_update_scale`` and the
    loss-scale entries of ``state_dict`` (Python numbers; fixed factor 2, no hysteresis).
    """

    def __init__(self, init_scale, scale_window, min_loss_scale):
        self.dynamic_loss_scale = True
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2
        self.cur_scale = init_scale
        self.scale_window = scale_window
        self.min_loss_scale = min_loss_scale

    def step(self, skip: bool):
        if skip:
            self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_loss_scale)
            self.last_overflow_iter = self.cur_iter
        else:
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if (stable_interval > 0) and (stable_interval % self.scale_window == 0):
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1
        # FP16_Optimizer.step returns before the inner step on overflow.
        return self.cur_scale, skip

    def state_dict(self):
        return {
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "scale_factor": self.scale_factor,
            "scale_window": self.scale_window,
        }


class ApexUpdateScaleHysteresis:
    """apex csrc/update_scale_hysteresis.cu, ``update_scale_hysteresis_cuda_kernel`` (a float32
    scale, double factors, int trackers; no floor).
    """

    def __init__(self, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis):
        self.scale = F32(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def step(self, found_inf: bool):
        if found_inf:
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker > 0:
                self.growth_tracker = 0
                return self.scale, found_inf
            self.scale = f32(float(self.scale) * self.backoff_factor)
            self.growth_tracker = 0
        else:
            successful = self.growth_tracker + 1
            if successful == self.growth_interval:
                new_scale = f32(float(self.scale) * self.growth_factor)
                if np.isfinite(new_scale):
                    self.scale = new_scale
                self.growth_tracker = 0
            else:
                self.growth_tracker = successful
            self.hysteresis_tracker = self.hysteresis
        return self.scale, found_inf


class CerebrasGradScaler:
    """cerebras/pytorch/amp/grad_scaler.py, ``GradScaler.__init__`` (dynamic) and
    ``GradScaler.update_scale`` (float32 scale, int64 counters); ``step_if_finite`` skips.
    """

    def __init__(
        self,
        init_scale=2.0**15,
        steps_per_increase=2000,
        min_loss_scale=2.0**-14,
        max_loss_scale=2.0**15,
        overflow_tolerance=0.0,
    ):
        self._loss_scale = F32(min(max_loss_scale, init_scale))
        self._steps_since_rescale = 0
        self._overflows_since_rescale = 0
        self._overflow_tolerance = overflow_tolerance
        self._max_loss_scale = max_loss_scale
        self._min_loss_scale = min_loss_scale
        self._steps_per_increase = steps_per_increase

    def step(self, overflow: bool):
        isfinite_int = 0 if overflow else 1
        self._steps_since_rescale += 1
        self._overflows_since_rescale += 1 - isfinite_int
        ratio = F32(self._overflows_since_rescale) / F32(self._steps_since_rescale)
        exceeded = int(F32(self._overflow_tolerance) < ratio)
        self._loss_scale = F32(self._loss_scale / F32(1 + exceeded))
        reset = 1 - exceeded
        self._overflows_since_rescale *= reset
        self._steps_since_rescale *= reset
        increase = int(self._steps_per_increase < self._steps_since_rescale)
        with np.errstate(over="ignore"):
            self._loss_scale = F32(self._loss_scale * F32(1 + increase))
        reset = 1 - increase
        self._overflows_since_rescale *= reset
        self._steps_since_rescale *= reset
        max_ls = F32(self._max_loss_scale)
        self._loss_scale = self._loss_scale if self._loss_scale < max_ls else max_ls
        min_ls = F32(self._min_loss_scale)
        self._loss_scale = self._loss_scale if min_ls < self._loss_scale else min_ls
        return self._loss_scale, overflow


class MindSporeDynamicLossScaleUpdateCell:
    """mindspore/nn/wrap/loss_scale.py, ``DynamicLossScaleUpdateCell.construct`` (float32, int32),
    as built by ``DynamicLossScaleManager.get_update_cell`` (mindspore/train/loss_scale_manager.py).
    """

    def __init__(self, loss_scale_value=2**24, scale_factor=2, scale_window=2000):
        self.loss_scale = F32(loss_scale_value)
        self.scale_window = scale_window
        self.scale_factor = F32(scale_factor)
        self.cur_iter = 1
        self.last_overflow_iter = 0
        self.minimum_loss_scale = F32(1.0)

    def step(self, overflow: bool):
        reciprocal = F32(F32(1.0) / self.scale_factor)
        on_overflow = (
            max(F32(self.loss_scale * reciprocal), self.minimum_loss_scale)
            if overflow
            else self.loss_scale
        )
        should_inc = self.scale_window <= self.cur_iter - self.last_overflow_iter
        if overflow or should_inc:
            self.last_overflow_iter = self.cur_iter
        if should_inc and not overflow:
            with np.errstate(over="ignore"):
                self.loss_scale = F32(on_overflow * self.scale_factor)
        else:
            self.loss_scale = on_overflow
        self.cur_iter += 1
        # TrainOneStepWithLossScaleCell drops the update when overflow.
        return self.loss_scale, overflow


def comparable_prefix(scales, lo: float, hi: float) -> int:
    """How many leading reference scales lie in ``[lo, hi]`` (finite)."""
    for i, s in enumerate(scales):
        s = float(s)
        if not (math.isfinite(s) and lo <= s <= hi):
            return i
    return len(scales)


class ReferenceDynamic:
    """This library's ``DynamicScale`` docstring rule, with NumPy float32 scalars.

    ``step(overflow) -> (scale, overflow, stuck)``; ``growth`` and ``hyst`` are
    the counters after the step. Written from the docstring, not from the code.
    """

    def __init__(self, p):
        self.p = p
        self.scale = F32(p.init_scale)
        self.growth = 0
        self.hyst = 0

    def step(self, overflow: bool) -> tuple[float, bool, bool]:
        p = self.p
        stuck = overflow and self.scale <= F32(p.min_scale)
        if overflow:
            self.growth = 0
            self.hyst += 1
            if self.hyst >= p.hysteresis:
                self.scale = max(F32(self.scale * F32(p.backoff_factor)), F32(p.min_scale))
                self.hyst = 0
        else:
            self.growth += 1
            if p.consecutive_hysteresis:
                self.hyst = 0
            if self.growth >= p.growth_interval:
                with np.errstate(over="ignore"):
                    grown = F32(self.scale * F32(p.growth_factor))
                if np.isfinite(grown):
                    self.scale = min(grown, F32(p.max_scale))
                self.growth = 0
                self.hyst = 0
        return float(self.scale), overflow, stuck


class ReferenceHeadroom:
    """This library's ``HeadroomScale`` docstring rule, with NumPy float32 scalars.

    ``step(overflow, amax) -> (scale, overflow, stuck)``; ``peak``, ``margin`` and ``good``
    are the state after the step (``range_peak``, ``margin``, ``growth_count``). Written from
    the docstring, not from the code: the target is ``2 ** (floor(log2(1 / peak)) - margin)``,
    its exponent read with ``np.frexp``.
    """

    def __init__(self, p):
        self.p = p
        self.scale = F32(p.init_scale)
        self.peak = F32(0.0)
        self.margin = p.min_margin
        self.good = 0

    @staticmethod
    def target(peak, margin) -> np.float32:
        with np.errstate(divide="ignore", over="ignore"):
            inv = F32(1.0) / F32(peak)
        if not np.isfinite(inv):
            return F32(np.inf)
        e = int(np.frexp(inv)[1]) - 1 - int(margin)
        return F32(math.ldexp(1.0, e)) if e < 128 else F32(np.inf)

    def step(self, overflow: bool, amax: float) -> tuple[float, bool, bool]:
        p = self.p
        stuck = overflow and self.scale <= F32(p.min_scale)
        amax = F32(amax) if np.isfinite(amax) and amax >= 0 else F32(0.0)
        if overflow:
            self.good = 0
            if self.peak == 0:
                new = f32(self.scale * F32(p.blind_backoff))
            else:
                if self.margin < p.max_margin:
                    self.margin += 1
                else:
                    self.peak = max(self.peak, F32(F32(1.0) / self.scale))
                new = min(F32(self.scale * F32(0.5)), self.target(self.peak, self.margin))
        else:
            self.peak = max(amax, F32(self.peak * F32(2.0 ** (-1.0 / p.window))))
            self.good += 1
            if self.good >= p.margin_interval and self.margin > p.min_margin:
                self.margin -= 1
                self.good = 0
            if self.peak > 0:
                new = self.target(self.peak, self.margin)
            else:
                new = f32(self.scale * F32(2.0))
        hi = F32(min(p.max_scale, float(np.finfo(np.float32).max)))
        self.scale = F32(min(max(new, F32(p.min_scale)), hi))
        return float(self.scale), overflow, stuck
