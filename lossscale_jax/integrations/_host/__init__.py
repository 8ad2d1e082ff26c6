"""What every host integration needs, written once beside the hosts' folders.

A host is a framework whose trainer owns its step (Tunix, EasyDeL). Each host's integration
reads its own seams and calls these, which know no host:

``_changes`` (check, then apply: the refusal that leaves nothing changed, a target enabled
once, the default policy by compute dtype), ``_dtype`` (an NNX model switched to a compute
dtype, its norms kept in float32), ``_grad`` (a trainer's loss wrapped in
``lsj.value_and_grad``, and its gradients unscaled for the norms a trainer logs),
``_metrics`` (the loss scale's metrics, named for a host's logger, and the first skip said
once in a log line) and ``_mismatch`` (the rollout/trainer log-prob mismatch metrics).
"""
