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
          last_overflow_iter = iter
          overflows_since_rescale += 1
          pct = overflows_since_rescale / float(iter - last_rescale_iter)
          new = scale
          if pct >= tolerance:                      # always, at tolerance=0
              new = scale / scale_factor
              if threshold is not None: new = max(new, threshold)
              last_rescale_iter = iter; overflows_since_rescale = 0
          if new <= min_loss_scale: raise FloatingPointError   # scale kept
          scale = new
      elif (iter - last_overflow_iter) % scale_window == 0:
          scale *= scale_factor
          last_rescale_iter = iter                  # overflows_since_rescale is kept
      iter += 1

    The step fairseq raises ``FloatingPointError`` at has
    ``metrics(opt_state)["stuck"]`` True and keeps the scale, as fairseq
    does; pass ``on_stuck="error"`` to ``loss_scaling`` to stop there as
    fairseq does (a ``checkify`` error). ``stuck`` is also set by an overflow
    with the scale pinned at ``threshold``, where fairseq goes on skipping.

    With ``tolerance > 0`` the two counters the rule adds are the policy's own
    state (``state.policy_state``: ``iter_since_rescale``,
    ``overflows_since_rescale``), checkpointed with the rest; ``pct >= tolerance``
    is decided as Python decides it in float64 (``1 / 10 >= 0.1`` holds), with
    integer arithmetic. ``threshold`` is applied in float32; trajectories agree exactly with a
    power-of-two ``scale_factor`` (the default). A growth whose float32 result
    is not finite is refused, and the scale never goes below ``2**-126``.

    fairseq's command line builds it with ``init_scale=--fp16-init-scale``
    (default 128) and ``scale_window=--fp16-scale-window``, which defaults to
    ``int(2**14 / data_parallel_size / update_freq)``: pass that number.

    Args:
      init_scale, scale_factor, scale_window, tolerance, threshold, min_loss_scale:
        as in fairseq (``--fp16-scale-tolerance`` is ``tolerance``; a negative one
        is the same rule as 0).

    Returns:
      A policy for ``lsj.loss_scaling``.

    Raises:
      ValueError: for an argument out of range (a non-finite ``tolerance``).

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
      >>> p = compat.fairseq.DynamicLossScaler(init_scale=8.0, tolerance=0.5)
      >>> s = p.adjust(p.adjust(p.init(), False), True)   # 1 overflow in 2 iterations: back off
      >>> float(s.scale), {k: int(v) for k, v in s.policy_state.items()}
      (4.0, {'iter_since_rescale': 1, 'overflows_since_rescale': 0})
      >>> s = p.adjust(p.adjust(p.adjust(s, False), False), True)   # 1 in 3: tolerated
      >>> float(s.scale), bool(s.last_skipped), int(s.policy_state["overflows_since_rescale"])
      (4.0, True, 1)
    """
    init, factor, window, tol, thr, lo = check_args(
        init_scale, scale_factor, scale_window, tolerance, threshold, min_loss_scale, "fairseq"
    )
    return FairseqScale(init, factor, window, thr, lo, metaseq=False, tolerance=tol)


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
