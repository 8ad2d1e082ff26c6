"""float16 compute for Tunix's models: the attention mask constant, the compute dtype.

Every Tunix model masks attention with ``where(mask, scores, K_MASK)``, ``K_MASK =
-2.3819763e38``, a module constant read when the attention is traced. In float16 that
constant is ``-inf``, and a query row whose keys are all padding (every left-padded sequence
has them) is ``softmax(all -inf) = nan``, which spreads to the whole batch at the next layer:
float16 is nan from step 0, before loss scaling matters. :func:`patch_mask_constants` sets
it to float16's lowest finite value in every loaded ``tunix.models`` module (a masked entry
still contributes exactly 0 after ``exp``, in every dtype). A function traced before the
patch keeps the old constant, so JAX's caches are cleared when it changes.

Qwen2, Qwen3 (0.1.7) and Gemma4 compute in ``config.dtype`` with float32 parameters;
:func:`compute_dtype_change` switches a built one (its submodules copied ``config.dtype``
when they were built). MaxText's (its Transformer, or the TunixMaxTextAdapter around it)
compute in their own read-only config's dtype: ``_maxtext`` switches them as MaxText
builds them. The other models compute in their parameters' dtype. An RL cluster's
vanilla rollout samples from the actor's own variables through a graph it took when it was
built: :func:`rollout_change` gives it the switched one. Each returns the change to make,
having checked that it can be made: ``enable`` makes none until every check has passed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lossscale_jax.errors import IntegrationError
from lossscale_jax.integrations._host import _dtype
from lossscale_jax.integrations.tunix import _maxtext

_MODELS = "tunix.models."


def patch_mask_constants(dtype: Any) -> list[str]:
    """Sets ``K_MASK`` of every loaded ``tunix.models`` module to ``finfo(dtype).min`` where
    the constant is beyond ``dtype``'s range; the modules changed, by name."""
    low = float(jnp.finfo(dtype).min)
    changed = []
    for name, module in sorted(sys.modules.items()):
        value = getattr(module, "K_MASK", None) if name.startswith(_MODELS) else None
        if isinstance(value, float) and value < low:
            module.K_MASK = low  # pyright: ignore[reportAttributeAccessIssue]
            changed.append(name)
    if changed:
        jax.clear_caches()  # a function traced with the old constant would keep it
    return changed


def compute_dtype_change(model: Any, dtype: Any) -> Callable[[], None]:
    """What makes ``model`` compute in ``dtype``, checked now and done when called: its
    ``config.dtype`` and every submodule's ``dtype``, where the model has them; otherwise its
    floating parameters must already be ``dtype`` (it computes in them) and nothing changes.
    Raises ``IntegrationError`` (having changed nothing) where neither holds."""
    dtype = np.dtype(dtype)
    maxtext = _maxtext.compute_dtype_change(model, dtype)  # MaxText's: its own config
    if maxtext is not None:
        return maxtext
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "dtype"):
        modules = _dtype.own_dtype_modules(model)  # norms too: Tunix's upcast inside

        def change() -> None:
            for module in modules:
                module.dtype = dtype
            config.dtype = dtype

        return change
    kinds = {np.dtype(p.dtype) for p in _dtype.float_params(model)}
    if kinds != {dtype}:
        raise IntegrationError(
            f"lossscale_jax.integrations.tunix: {type(model).__name__} has no compute dtype "
            f"(its config has no `dtype`): it computes in its parameters' dtype, "
            f"{sorted(k.name for k in kinds)}, not {dtype.name}. Build it with {dtype.name} "
            "parameters (enable() then keeps float32 master copies in the optimizer: "
            "lsj.master_weights), use a model that has one (Qwen2, Qwen3, Gemma4), or pass "
            "compute_dtype=None to train it as it is."
        )
    return lambda: None


def compute_dtype_of(model: Any) -> np.dtype | None:
    """The dtype ``model`` computes in: its ``config.dtype``, else its floating parameters'
    one dtype (``None``: not known); a MaxText model's, its config's."""
    maxtext = _maxtext.compute_dtype_of(model)
    if maxtext is not None:
        return maxtext
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "dtype", None) is not None:
        return np.dtype(config.dtype)
    kinds = {np.dtype(p.dtype) for p in _dtype.float_params(model)}
    return kinds.pop() if len(kinds) == 1 else None


def rollout_change(cluster: Any, dtype: Any) -> Callable[[], None]:
    """What makes the cluster's vanilla rollout sample in ``dtype`` too (its sampler kept the
    model's graph from before the change), checked now and done when called; another engine
    computes in its own dtype, and nothing changes for it."""
    sampler = getattr(cluster.rollout, "_sampler", None)
    if sampler is None:
        return lambda: None
    if not hasattr(sampler, "_transformer_graphdef"):
        raise IntegrationError(
            "lossscale_jax.integrations.tunix: the rollout's sampler keeps no model graph "
            "it can switch to another compute dtype; build the model with that dtype "
            "(its ModelConfig(dtype=...)) and pass compute_dtype=None."
        )
    model = cluster.rollout.model()
    change = compute_dtype_change(model, dtype)

    def refresh() -> None:
        change()
        sampler._transformer_graphdef = nnx.graphdef(model)

    return refresh
