# pyright: reportMissingImports=false
# (qwix comes with Tunix, an optional dependency: the type check runs without it installed.)
"""LoRA in a model whose parameters are wider than the dtype it computes in.

qwix's LoRA (``qwix.LoraProvider``, which Tunix's examples apply with
``qwix.apply_lora_to_model``) adds ``x @ a @ b * alpha / rank`` to each targeted projection,
``a`` and ``b`` in the base weight's *parameter* dtype. A Tunix model with float32
parameters that computes in float16 (its ``config.dtype``, what ``enable`` sets) then gets
float32 back from every targeted projection:

- ``v_proj``'s output meets the float16 key/value cache of the rollout, and the first
  rollout dies in ``lax.dynamic_update_slice`` ("requires arguments to have the same
  dtypes, got float16, float32"); ``q_proj`` and ``k_proj`` escape only because
  ``q_norm``/``k_norm`` cast back;
- ``o_proj``'s and the MLP's outputs turn the residual stream float32: the model computes
  partly in float32, silently.

:func:`install` makes each of the provider's LoRA ops return the dtype its base op computes
in (the result dtype of its operands, or its ``preferred_element_type``), as PEFT's LoRA
layers cast their sum back to the base layer's result dtype: the low-rank branch is computed
as qwix computes it (in the parameters' dtype) and the sum rounded once to the compute dtype.
Where the two dtypes agree (float32 compute, or parameters built in the compute dtype)
nothing changes; operands qwix quantized (QLoRA) are left as they are.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

OPS = ("einsum", "dot_general", "conv_general_dilated")  # LoraProvider's methods wrapped
_MARK = "_lossscale_jax_casts_back"


def provider() -> type | None:
    """``qwix.LoraProvider``, or ``None`` where qwix is not installed."""
    try:
        import qwix
    except ImportError:
        return None
    return qwix.LoraProvider


def install() -> bool:
    """Wraps ``qwix.LoraProvider``'s LoRA ops (once per process): each returns its base op's
    dtype. Whether it was installed now (traces made before keep the old ops: JAX's caches
    are cleared then)."""
    cls = provider()
    if cls is None or getattr(getattr(cls, OPS[0]), _MARK, False):
        return False
    for name in OPS:
        setattr(cls, name, _casting_back(name, getattr(cls, name)))
    jax.clear_caches()
    return True


def _casting_back(name: str, op: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(op)

    @functools.wraps(op)
    def casting_back(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = op(self, *args, **kwargs)
        want = _base_dtype(name, signature.bind(self, *args, **kwargs).arguments)
        if want is None or out.dtype == want or not jnp.issubdtype(out.dtype, jnp.floating):
            return out
        return out.astype(want)

    setattr(casting_back, _MARK, True)
    return casting_back


def _base_dtype(name: str, bound: dict[str, Any]) -> np.dtype | None:
    """The dtype the base op computes in, from its bound arguments (``None``: not known, an
    operand is not an array)."""
    if name == "einsum":
        operands, options = bound["operands"], bound.get("kwargs", {})
    else:
        operands, options = (bound["lhs"], bound["rhs"]), bound
    preferred = options.get("preferred_element_type")
    if preferred is not None:
        return np.dtype(preferred)
    if not all(isinstance(x, jax.Array | np.ndarray) for x in operands):
        return None
    want = np.dtype(jnp.result_type(*operands))
    return want if jnp.issubdtype(want, jnp.floating) else None
