"""The loss-scale state inside an optimizer state: reading it, writing it, reporting it.

Holds ``_access`` (``get_loss_scale_state``, ``set_loss_scale_state``, ``switch_policy``,
``scale_loss``: it taps the loss, so it sits above ``taps``), ``_metrics`` (``metrics``,
computed on the device, and ``overflowed_leaves``, on the host) and ``_rollback`` (what a
step wrote into model state, kept or rolled back: ``rollback_if_skipped``, and the pieces the
Flax train states use). They find the state where a
front-end put it (``engine/_nesting``), whatever wraps it.

May import: what lies below it in the package's order (``engine``, ``policies``, ``taps``) and
``errors``. It exports no public name: its functions are public as ``lossscale_jax.X`` and
``lossscale_jax.transform.X``.
"""
