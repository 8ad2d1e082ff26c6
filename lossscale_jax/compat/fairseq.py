"""fairseq (``fairseq/optim/dynamic_loss_scaler.py``).

``DynamicLossScaler`` builds the policy that fairseq's ``FP16Optimizer`` and
``MemoryEfficientFP16Optimizer`` run; ``import_state``/``export_state`` read and
write the ``"loss_scale"`` entry those optimizers add to their ``state_dict()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lossscale_jax.compat._common import _field, _host, _resumed, _saved_scale
from lossscale_jax.compat._fairseq_scale import FairseqScale, check_args
from lossscale_jax.policies import LossScalePolicy, LossScaleState

__all__ = ["DynamicLossScaler", "import_state", "export_state"]


def DynamicLossScaler(
    init_scale: float = 2.0**15,
    scale_factor: float = 2.0,
    scale_window: int = 2000,
    tolerance: float = 0.0,
    threshold: float | None = None,
    min_loss_scale: float = 1e-4,
) -> LossScalePolicy:
    """fairseq's dynamic scaler: grow after ``scale_window`` good steps, halve on overflow.

    Rule (``check_overflow`` on an overflow, ``update`` after a good step; a
    Python float scale in fairseq, float32 here)::

      if overflow:                                  # OverflowError: the step is skipped
          new = scale / scale_factor
          if threshold is not None: new = max(new, threshold)
          if new <= min_loss_scale: raise FloatingPointError   # scale kept
          scale = new
      elif (iter - last_overflow_iter) % scale_window == 0:
          scale *= scale_factor
      iter += 1

    The step fairseq raises ``FloatingPointError`` at has
    ``metrics(opt_state)["stuck"]`` True and keeps the scale, as fairseq
    does; pass ``on_stuck="error"`` to ``loss_scaling`` to stop there as
    fairseq does (a ``checkify`` error). ``stuck`` is also set by an overflow
    with the scale pinned at ``threshold``, where fairseq goes on skipping.

    ``tolerance > 0`` is refused: fairseq then backs off only when the
    overflows since the last backoff reach ``tolerance`` times the iterations
    since the last rescale, a third counter the state does not hold.
    ``threshold`` is applied in float32; trajectories agree exactly with a
    power-of-two ``scale_factor`` (the default). A growth whose float32 result
    is not finite is refused, and the scale never goes below ``2**-126``.

    fairseq's command line builds it with ``init_scale=--fp16-init-scale``
    (default 128) and ``scale_window=--fp16-scale-window``, which defaults to
    ``int(2**14 / data_parallel_size / update_freq)``: pass that number.

    Args:
      init_scale, scale_factor, scale_window, tolerance, threshold, min_loss_scale:
        as in fairseq; ``tolerance`` must be 0 (or below: the same rule).

    Returns:
      A policy for ``lsj.loss_scaling``.

    Raises:
      ValueError: for ``tolerance > 0`` (see above) or an argument out of range.

    Examples:
      >>> from lossscale_jax import compat
      >>> p = compat.fairseq.DynamicLossScaler(init_scale=8.0, scale_window=2, threshold=4.0)
      >>> s = p.adjust(p.init(), True)
      >>> float(s.scale), bool(s.stuck)
      (4.0, False)
      >>> s = p.adjust(s, True)                     # pinned at threshold
      >>> float(s.scale), bool(s.stuck)
      (4.0, True)
      >>> float(p.adjust(p.adjust(s, False), False).scale)
      8.0
    """
    init, factor, window, thr, lo = check_args(
        init_scale, scale_factor, scale_window, tolerance, threshold, min_loss_scale, "fairseq"
    )
    return FairseqScale(init, factor, window, thr, lo, metaseq=False)


def import_state(
    state_dict: Mapping[str, Any],
    *,
    scale_factor: float = 2.0,
    scale_window: int = 2000,
    tolerance: float = 0.0,
    threshold: float | None = None,
    min_loss_scale: float = 1e-4,
) -> tuple[LossScalePolicy, LossScaleState]:
    """The policy and state of a fairseq FP16 optimizer's ``state_dict()``.

    fairseq saves the scale alone (``state_dict["loss_scale"]``); its
    ``load_state_dict`` sets the scaler's ``loss_scale`` and nothing else.
    Rule::

      policy = DynamicLossScaler(loss_scale, scale_factor, scale_window, tolerance,
                                 threshold, min_loss_scale)
      state = policy.init()                         # counters from zero, as in fairseq

    Args:
      state_dict: the optimizer's ``state_dict()`` (any mapping with a
        ``"loss_scale"`` entry; the other entries are the inner optimizer's).
      scale_factor, scale_window, tolerance, threshold, min_loss_scale: the
        scaler's arguments, as the run built it.

    Returns:
      ``(policy, state)``.

    Examples:
      >>> from lossscale_jax import compat
      >>> policy, state = compat.fairseq.import_state({"loss_scale": 512.0}, scale_window=128)
      >>> float(state.scale), int(state.growth_count)
      (512.0, 0)
    """
    what = "the fairseq optimizer state_dict"
    scale = _saved_scale("loss_scale", _field(state_dict, "loss_scale", what))
    policy = DynamicLossScaler(
        scale, scale_factor, scale_window, tolerance, threshold, min_loss_scale
    )
    return policy, _resumed(policy)


def export_state(policy: LossScalePolicy, state: LossScaleState) -> dict[str, Any]:
    """``{"loss_scale": scale}``, to merge into the ``state_dict()`` fairseq loads.

    The counters are not saved by fairseq, so they are not exported: a run
    resumed in fairseq restarts its growth count, as fairseq's own resume
    does.

    Args:
      policy: built by ``compat.fairseq.DynamicLossScaler`` (or ``import_state``).
      state: its ``LossScaleState``.

    Returns:
      ``{"loss_scale": float}``.

    Raises:
      ValueError: if ``policy`` is not a fairseq scaler.
      TypeError: if ``state`` is not a ``LossScaleState``.

    Examples:
      >>> from lossscale_jax import compat
      >>> p = compat.fairseq.DynamicLossScaler(init_scale=128.0)
      >>> compat.fairseq.export_state(p, p.adjust(p.init(), True))
      {'loss_scale': 64.0}
    """
    scale, _, _ = _host(state)
    if not (isinstance(policy, FairseqScale) and not policy.metaseq):
        raise ValueError(
            f"policy {policy!r} has no fairseq equivalent: export needs a policy built by "
            "compat.fairseq.DynamicLossScaler."
        )
    return {"loss_scale": scale}
