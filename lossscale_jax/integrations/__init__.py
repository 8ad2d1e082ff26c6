"""Trainers that own their step: a folder per framework, each an optional dependency.

A framework whose trainer computes ``grad(loss)`` and applies the update itself has no place
for ``lsj.scale_loss`` between the two. An integration gives it one with the least of the
framework's code: it swaps in the library's optimizer and a step built on
``lsj.value_and_grad`` (never a second copy of the engine's step), checks the names of the
framework it relies on (a release that lacks one is refused, naming it), makes every check
before its first change, and imports the framework only there.

Holds a folder per host framework, and ``_host``, what every host needs written once beside
them (check-then-apply, the NNX compute-dtype switch with norms in float32, the loss wrapped
in ``lsj.value_and_grad``, the loss scale's metrics for a host's logger and what a skipped
step was, said in a log line, the rollout/trainer mismatch metrics):

- ``tunix`` (``enable``: Tunix's SFT and RL trainers, public), with its parts: ``_step`` (the
  train step and its metrics), ``_accumulating_step`` (the step on Tunix's main branch,
  whose trainer has a gradient accumulator of its own), ``_optimizer`` (the loss-scaled
  optimizer from the trainer's, its accumulation kept), ``_models`` (float16 compute for
  Tunix's models: their attention mask constant, their compute dtype), ``_checkpoint``
  (checkpoints of the loss-scaled optimizer), ``_mismatch`` (the rollout/trainer log-prob
  mismatch, logged each step), ``_lora`` (qwix's LoRA in the compute dtype), ``_seams`` (the
  names of Tunix it relies on) and ``_maxtext`` (MaxText's post-training on Tunix: its
  models' compute dtype, set through their own config; its SFT trainer's own step, kept;
  MaxText found through ``sys.modules``, never imported where the program has not);
- ``easydel`` (``enable``: EasyDeL's trainers, public), with ``_seams`` (the names of EasyDeL
  it relies on) and ``_step`` (the loss-scaled copy of an EasyDeL training step).

May import: everything else in the package (it sits above ``compat`` and ``presets``) and
``errors``. Nothing in the package imports it; ``import lossscale_jax`` does not load it.
"""
