"""The engine: the one step every front-end calls, and what it is made of (internals).

Holds the ``Engine`` (``_engine``: check, decide, select; ``EngineUpdate``), the Optax path's
decision through it (``_inner_skip``: ``inner_or_skip``, a skipped step's updates) and its
parts: the check's kernels (``_check``; in rows where a step is lowered for a GPU,
``_check_rows``), the unscale (``_unscale``), the collective and the mapped-axis rules
(``_devices``), the skip's formulation per backend (``_skip``) and what the platform a step is
lowered for picks with no conditional (``_platform``: the CPU's fence in the skip, the check's
formulation, the state's scalars in one kernel on the CPU), the state and its telemetry
(``_state``), the policy protocol the engine calls (``_policy``: ``LossScalePolicy``, so that
the engine never imports ``policies/``), ``on_stuck`` (``_stuck``), the taps' statistics vector
it reads (``_tap_stats``), the loss's dtype note (``_loss_note``), the optimizer states the
front-ends keep (``_opt_states``), where a ``LossScaleState`` sits and the nestings refused
(``_nesting``), accumulation windows (``_window``), hyperparameter checks (``_hyper``), exact
divisions and ratios (``_division``, ``_ratio``), ``jnp.where`` and ``jnp.isinf`` without their
nested jit (``_ops``), ``ClosedJaxpr`` across JAX versions (``_jaxprs``), the wiring check that
refuses a step wired to train silently wrong (``_wiring``: its switches and flow; ``_powers``:
the power of the scale a value carries, rule by primitive; ``_interpret``: those rules run over
a traced step and the programs it holds; ``_verdicts``: what a gradient's powers say, in its
messages), where an update lands (``_landing``: float16 parameters, master copies, the landing
check) and the tracing internals it reads (``_tracers``, the one module that imports
``jax._src``).

May import: ``lossscale_jax.errors`` and its own modules; it is the bottom of the package.
Every other folder and module may import it. It exports no public name: the public names
built on it live in ``lossscale_jax``, ``numerics``, ``policies``, ``stuck`` and the
front-end modules.
"""
