"""metaseq (``metaseq/optim/dynamic_loss_scaler.py``), the scaler OPT-175B trained with.

``DynamicLossScaler`` builds the policy that metaseq's ``FP16Optimizer`` and
``MemoryEfficientFP16Optimizer`` run; ``import_state``/``export_state`` read and
write the ``"loss_scale"`` entry of their ``state_dict()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lossscale_jax.compat._common import _field, _host, _resumed, _saved_scale
from lossscale_jax.compat._fairseq_scale import FairseqScale, check_args
from lossscale_jax.policies import LossScalePolicy, LossScaleState

__all__ = ["DynamicLossScaler", "import_state", "export_state"]


def DynamicLossScaler(
    init_scale: float = 4.0,
    scale_factor: float = 2.0,
    scale_window: int = 256,
    tolerance: float = 0.0,
    threshold: float | None = None,
    min_loss_scale: float = 2.0**-5,
) -> LossScalePolicy:
    """metaseq's dynamic scaler: the growth window follows the scale; skips at its minimum.

    Rule (``check_overflow`` on an overflow, ``update`` after a good step; a
    Python float scale in metaseq, float32 here)::

      if overflow:                                  # OverflowError: the step is skipped
          last_overflow_iter = iter
          overflows_since_rescale += 1
          pct = overflows_since_rescale / float(iter - last_rescale_iter)
          new = scale
          if pct >= tolerance:                      # always, at tolerance=0
              new = scale / scale_factor
              window = max(int(window / scale_factor), 1)
              if threshold is not None: new = max(new, threshold)
              last_rescale_iter = iter; overflows_since_rescale = 0
          if new < min_loss_scale: new = scale      # no error: keeps skipping
          scale = new
      elif (iter - last_overflow_iter) % window == 0:
          scale *= scale_factor
          window *= scale_factor
          last_rescale_iter = iter                  # overflows_since_rescale is kept
      iter += 1

    The window is halved by every backoff, also one that leaves the scale at
    its minimum, so the window is a second state: ``hysteresis_count`` holds
    it (see ``metrics``: it is not an overflow count for this policy), and
    ``growth_count`` the good steps since the last overflow. Because the
    count runs on past a growth while the window doubles, the growths after an
    overflow come ``w, w, 2w, 4w, ...`` good steps apart (``w`` the window
    then), as in metaseq. An overflow that leaves the scale where it was sets
    ``metrics(opt_state)["stuck"]``; metaseq goes on skipping, and so does
    ``on_stuck="skip"`` (the default).

    With ``tolerance > 0`` the rule's two counters are the policy's own state
    (``state.policy_state``, as in ``compat.fairseq``). ``scale_factor`` must be
    a whole number, so the window stays a whole
    number (metaseq would make it fractional). Trajectories agree exactly
    with a power-of-two ``scale_factor`` (the default); ``threshold`` is
    applied in float32; a growth whose float32 result is not finite is
    refused; the scale never goes below ``2**-126``.

    Args:
      init_scale, scale_factor, scale_window, tolerance, threshold, min_loss_scale:
        as in metaseq (its defaults; metaseq's command line defaults are the
        same: ``--fp16-init-scale 4``, ``--fp16-scale-window 256``,
        ``--min-loss-scale 2**-5``).

    Returns:
      A policy for ``lsj.loss_scaling``.

    Raises:
      ValueError: for a fractional ``scale_factor`` or an argument out of range.

    Examples:
      >>> from lossscale_jax import compat
      >>> p = compat.metaseq.DynamicLossScaler(init_scale=4.0, scale_window=2)
      >>> s = p.init()
      >>> for _ in range(2):
      ...     s = p.adjust(s, False)
      >>> float(s.scale), int(s.hysteresis_count)   # grown; the window doubled
      (8.0, 4)
      >>> s = p.adjust(s, True)
      >>> float(s.scale), int(s.hysteresis_count)
      (4.0, 2)
    """
    init, factor, window, tol, thr, lo = check_args(
        init_scale, scale_factor, scale_window, tolerance, threshold, min_loss_scale, "metaseq"
    )
    if not factor.is_integer():
        raise ValueError(
            f"scale_factor must be a whole number for metaseq's scaler, got {scale_factor!r}: "
            "it multiplies scale_window by scale_factor, and a fractional window is not held."
        )
    return FairseqScale(init, factor, window, thr, lo, metaseq=True, tolerance=tol)


def import_state(
    state_dict: Mapping[str, Any],
    *,
    scale_factor: float = 2.0,
    scale_window: int = 256,
    tolerance: float = 0.0,
    threshold: float | None = None,
    min_loss_scale: float = 2.0**-5,
) -> tuple[LossScalePolicy, LossScaleState]:
    """The policy and state of a metaseq FP16 optimizer's ``state_dict()``.

    metaseq saves the scale alone; its ``load_state_dict`` sets
    ``loss_scale`` and leaves the window at ``scale_window`` (the value the
    run was started with), whatever the scale. Rule::

      policy = DynamicLossScaler(loss_scale, scale_factor, scale_window, tolerance,
                                 threshold, min_loss_scale)
      state = policy.init()                         # window = scale_window

    Args:
      state_dict: the optimizer's ``state_dict()`` (a mapping with a
        ``"loss_scale"`` entry).
      scale_factor, scale_window, tolerance, threshold, min_loss_scale: the
        scaler's arguments, as the run built it.

    Returns:
      ``(policy, state)``.

    Examples:
      >>> from lossscale_jax import compat
      >>> policy, state = compat.metaseq.import_state({"loss_scale": 0.5})
      >>> float(state.scale), int(state.hysteresis_count)
      (0.5, 256)
    """
    what = "the metaseq optimizer state_dict"
    scale = _saved_scale("loss_scale", _field(state_dict, "loss_scale", what))
    policy = DynamicLossScaler(
        scale, scale_factor, scale_window, tolerance, threshold, min_loss_scale
    )
    return policy, _resumed(policy)


def export_state(policy: LossScalePolicy, state: LossScaleState) -> dict[str, Any]:
    """``{"loss_scale": scale}``, to merge into the ``state_dict()`` metaseq loads.

    metaseq saves neither its window nor its counters; a run resumed there
    restarts them (the window at its ``scale_window``).

    Args:
      policy: built by ``compat.metaseq.DynamicLossScaler`` (or ``import_state``).
      state: its ``LossScaleState``.

    Returns:
      ``{"loss_scale": float}``.

    Raises:
      ValueError: if ``policy`` is not a metaseq scaler.
      TypeError: if ``state`` is not a ``LossScaleState``.

    Examples:
      >>> from lossscale_jax import compat
      >>> p = compat.metaseq.DynamicLossScaler()
      >>> compat.metaseq.export_state(p, p.init())
      {'loss_scale': 4.0}
    """
    scale, _, _ = _host(state)
    if not (isinstance(policy, FairseqScale) and policy.metaseq):
        raise ValueError(
            f"policy {policy!r} has no metaseq equivalent: export needs a policy built by "
            "compat.metaseq.DynamicLossScaler."
        )
    return {"loss_scale": scale}
