"""An NNX model switched to a compute dtype, its norms kept in float32.

A module that computes in its own ``dtype`` attribute (Flax's layers, and the hosts' layers
built on their pattern: EasyDeL's, Tunix's Qwen and Gemma) is switched by setting it. A
norm's ``dtype`` is set to float32 instead: the mean of squares and its ``rsqrt`` overflow in
float16 (a hidden state of 256 squares to 65,536, past float16's 65,504, and ``rsqrt``'s
backward divides by the cube of a root), so in float16 the norms' gradients are inf or nan
from the first step whatever the loss scale. A norm in float32 computes there and casts its
output back to its input's dtype: the layers around it stay in ``dtype``. A norm is a module
whose class name has ``Norm`` in it (``LayerNorm``, ``RMSNorm``, ``GroupNorm``, a host's own
``RMSNormGated``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lossscale_jax.errors import IntegrationError
from lossscale_jax.integrations._host._changes import Change

NORM_DTYPE = np.dtype(np.float32)


def is_norm(module: Any) -> bool:
    """Whether ``module`` is a normalisation layer (its class name has ``Norm`` in it)."""
    return "Norm" in type(module).__name__


def own_dtype_modules(model: Any) -> list[Any]:
    """The submodules of ``model`` (itself included) that compute in their own floating
    ``dtype`` attribute."""
    return [m for _, m in nnx.iter_graph(model) if _computes_in_own_dtype(m)]


def compute_dtype_change(model: Any, dtype: Any, host: str) -> Change:
    """What makes ``model`` compute in ``dtype`` with its norms in float32, checked now and
    done when called: every submodule's ``dtype``, where it has one; otherwise the model's
    floating parameters must already be ``dtype`` (it computes in them) and nothing changes.
    Raises ``IntegrationError`` (having changed nothing) where neither holds."""
    dtype = np.dtype(dtype)
    modules = own_dtype_modules(model)
    if modules:

        def change() -> None:
            for module in modules:
                module.dtype = NORM_DTYPE if is_norm(module) else dtype

        return change
    kinds = {np.dtype(p.dtype) for p in float_params(model)}
    if kinds != {dtype}:
        raise IntegrationError(
            f"lossscale_jax.integrations.{host}: {type(model).__name__} has no compute dtype "
            "(no module of it has a `dtype`): it computes in its parameters' dtype, "
            f"{sorted(k.name for k in kinds)}, not {dtype.name}. Build it with a compute "
            f"dtype, or pass compute_dtype=None to train it as it is."
        )
    return lambda: None


def compute_dtype_of(model: Any) -> np.dtype | None:
    """The dtype ``model`` computes in: its modules' own (norms aside), else its floating
    parameters' one dtype; ``None`` where that is not one dtype."""
    own = {np.dtype(m.dtype) for m in own_dtype_modules(model) if not is_norm(m)}
    kinds = own or {np.dtype(p.dtype) for p in float_params(model)}
    return kinds.pop() if len(kinds) == 1 else None


def float_params(model: Any) -> list[Any]:
    """The floating parameter arrays of ``model``."""
    state = nnx.state(model, nnx.Param)
    return [x for x in jax.tree_util.tree_leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]


def _computes_in_own_dtype(module: Any) -> bool:
    own = getattr(module, "dtype", None) if isinstance(module, nnx.Module) else None
    try:
        return own is not None and jnp.issubdtype(own, jnp.floating)
    except TypeError:  # a dtype attribute that is not a dtype
        return False
