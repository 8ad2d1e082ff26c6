"""fairseq's, metaseq's and Colossal-AI's loss-scale rules, transcribed into plain Python.

As ``reference_scalers.py``: each class keeps the original's state in the original's number
type (Python floats for fairseq and metaseq, float32 for Colossal-AI's tensors) and exposes
``step(overflow) -> (scale, skipped)``; the source file is named on each class. The
trainers call ``check_overflow`` (which raises ``OverflowError`` on an overflow, and
``FloatingPointError`` at fairseq's minimum) and, after a good step, ``update``.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


class FairseqDynamicLossScaler:
    """fairseq/optim/dynamic_loss_scaler.py (``metaseq=True``: metaseq's copy,
    metaseq/optim/dynamic_loss_scaler.py, whose window follows the scale and which keeps
    the scale at ``min_loss_scale`` instead of raising). ``raised`` is set by the step at
    which fairseq raises ``FloatingPointError``.
    """

    def __init__(
        self,
        init_scale=2.0**15,
        scale_factor=2.0,
        scale_window=2000,
        tolerance=0.0,
        threshold=None,
        min_loss_scale=1e-4,
        metaseq=False,
    ):
        self.loss_scale = init_scale
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.tolerance = tolerance
        self.threshold = threshold
        self._iter = 0
        self._last_overflow_iter = -1
        self._last_rescale_iter = -1
        self._overflows_since_rescale = 0
        self.min_loss_scale = min_loss_scale
        self.metaseq = metaseq
        self.raised = False

    def update(self):
        if (self._iter - self._last_overflow_iter) % self.scale_window == 0:
            self.loss_scale *= self.scale_factor
            self._last_rescale_iter = self._iter
            if self.metaseq:
                self.scale_window *= self.scale_factor
        self._iter += 1

    def _decrease_loss_scale(self):
        self.loss_scale /= self.scale_factor
        if self.metaseq:
            self.scale_window = max(int(self.scale_window / self.scale_factor), 1)
        if self.threshold is not None:
            self.loss_scale = max(self.loss_scale, self.threshold)

    def check_overflow(self, overflow):
        if overflow:
            prev_scale = self.loss_scale
            iter_since_rescale = self._iter - self._last_rescale_iter
            self._last_overflow_iter = self._iter
            self._overflows_since_rescale += 1
            pct_overflow = self._overflows_since_rescale / float(iter_since_rescale)
            if pct_overflow >= self.tolerance:
                self._decrease_loss_scale()
                self._last_rescale_iter = self._iter
                self._overflows_since_rescale = 0
            if self.metaseq:
                if self.loss_scale < self.min_loss_scale:
                    self.loss_scale = prev_scale
            elif self.loss_scale <= self.min_loss_scale:
                self.loss_scale = prev_scale
                raise FloatingPointError("Minimum loss scale reached")
            self._iter += 1
            raise OverflowError("setting loss scale to: " + str(self.loss_scale))

    def step(self, overflow: bool):
        try:
            self.check_overflow(overflow)
        except OverflowError:
            return self.loss_scale, True
        except FloatingPointError:
            self.raised = True
            return self.loss_scale, True
        self.update()
        return self.loss_scale, False


class ColossalDynamicGradScaler:
    """colossalai/amp/naive_amp/grad_scaler/dynamic_grad_scaler.py ``DynamicGradScaler.update``
    (float32 tensors of shape (1,), held here as float32 scalars)."""

    def __init__(
        self,
        initial_scale=2**16,
        growth_factor=2,
        backoff_factor=0.5,
        growth_interval=1000,
        min_scale=None,
        max_scale=None,
        hysteresis=2,
    ):
        self._scale = F32(initial_scale)
        self._min_scale = F32(min_scale) if min_scale else None
        self._max_scale = F32(max_scale) if max_scale else None
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._growth_step = 0
        self._hysteresis = hysteresis
        self._hysteresis_step = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self._hysteresis_step += 1
            self._growth_step = 0
            if self._hysteresis_step >= self._hysteresis:
                self._scale = F32(self._scale * F32(self._backoff_factor))
                if self._min_scale:
                    self._scale = max(self._scale, self._min_scale)
        else:
            self._growth_step += 1
            if self._growth_step == self._growth_interval:
                self._growth_step = 0
                self._hysteresis_step = 0
                with np.errstate(over="ignore"):
                    self._scale = F32(self._scale * F32(self._growth_factor))
                if self._max_scale:
                    self._scale = min(self._scale, self._max_scale)

    def step(self, overflow: bool):
        self.update(overflow)
        return float(self._scale), overflow
