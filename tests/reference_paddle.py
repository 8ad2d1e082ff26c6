"""PaddlePaddle's two loss-scale rules, transcribed into plain Python with NumPy float32.

``step(overflow) -> (scale, skipped)``, as ``reference_torch_world.py``. Each class names the
source it follows; the scale is float32 as Paddle's (a float32 tensor multiplied by a float
ratio, computed in float32), with no floor and no guard against ``inf`` where Paddle has none.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


class PaddleGradScaler:
    """python/paddle/amp/grad_scaler.py, ``AmpScaler._update`` (``GradScaler`` subclasses it)."""

    def __init__(
        self,
        init_loss_scaling=2.0**16,
        incr_ratio=2.0,
        decr_ratio=0.5,
        incr_every_n_steps=2000,
        decr_every_n_nan_or_inf=1,
    ):
        self._scale = F32(init_loss_scaling)
        self._incr_ratio = incr_ratio
        self._decr_ratio = decr_ratio
        self._incr_every_n_steps = incr_every_n_steps
        self._decr_every_n_nan_or_inf = decr_every_n_nan_or_inf
        self._incr_count = 0
        self._decr_count = 0

    def _update(self, found_inf: bool) -> None:
        with np.errstate(over="ignore", under="ignore"):
            if found_inf:
                self._incr_count = 0
                self._decr_count = self._decr_count + 1
                if self._decr_count == self._decr_every_n_nan_or_inf:
                    self._scale = F32(self._scale * F32(self._decr_ratio))
                    self._decr_count = 0
            else:
                self._decr_count = 0
                self._incr_count = self._incr_count + 1
                if self._incr_count == self._incr_every_n_steps:
                    self._scale = F32(self._scale * F32(self._incr_ratio))
                    self._incr_count = 0

    def step(self, overflow: bool):
        self._update(overflow)  # GradScaler.step skips optimizer.step() on found_inf
        return float(self._scale), overflow


class PaddleUpdateLossScalingOp:
    """paddle/phi/kernels/impl/amp_kernel_impl.h, ``Update`` (T = float for the scale)."""

    def __init__(
        self,
        prev_loss_scaling,
        incr_every_n_steps,
        decr_every_n_nan_or_inf,
        incr_ratio,
        decr_ratio,
        good_steps=0,
        bad_steps=0,
    ):
        self.loss_scaling = F32(prev_loss_scaling)
        self.good = good_steps
        self.bad = bad_steps
        self.incr_every_n_steps = incr_every_n_steps
        self.decr_every_n_nan_or_inf = decr_every_n_nan_or_inf
        self.incr_ratio = F32(incr_ratio)  # the attributes are C++ floats
        self.decr_ratio = F32(decr_ratio)

    def update(self, found_inf: bool) -> None:
        with np.errstate(over="ignore", under="ignore"):
            if found_inf:
                self.good = 0
                self.bad = self.bad + 1
                if self.bad == self.decr_every_n_nan_or_inf:
                    new = F32(self.loss_scaling * self.decr_ratio)
                    self.loss_scaling = F32(1) if new < F32(1) else new
                    self.bad = 0
            else:
                self.bad = 0
                self.good = self.good + 1
                if self.good == self.incr_every_n_steps:
                    new = F32(self.loss_scaling * self.incr_ratio)
                    self.loss_scaling = new if np.isfinite(new) else self.loss_scaling
                    self.good = 0

    def step(self, overflow: bool):
        self.update(overflow)  # the op zeroes the gradients on found_inf: the step is void
        return float(self.loss_scaling), overflow
