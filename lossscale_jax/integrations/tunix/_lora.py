# pyright: reportMissingImports=false
# (qwix comes with Tunix, an optional dependency: the type check runs without it installed.)
"""LoRA in a model whose parameters are wider than the dtype it computes in.

qwix's LoRA (``qwix.LoraProvider``, which Tunix's examples apply with
``qwix.apply_lora_to_model``) adds ``x @ a @ b * alpha / rank`` to each targeted projection,
with ``a`` and ``b`` as they are stored: in the base weight's *parameter* dtype. A Tunix model
with float32 parameters that computes in float16 (its ``config.dtype``, what ``enable``
sets) then gets float32 back from every targeted projection:

- ``v_proj``'s output meets the float16 key/value cache of the rollout, and the first
  rollout dies in ``lax.dynamic_update_slice`` ("requires arguments to have the same
  dtypes, got float16, float32"); ``q_proj`` and ``k_proj`` escape only because
  ``q_norm``/``k_norm`` cast back;
- ``o_proj``'s and the MLP's outputs turn the residual stream float32: the model computes
  partly in float32, silently, with float32 copies of its activations kept for the backward.

:func:`install` makes the LoRA branch compute in the dtype its base op computes in (the
result dtype of the base op's operands, or its ``preferred_element_type``), as the base op
computes in it: ``a`` and ``b`` are cast to it where qwix reads them
(``_get_or_create_lora_params``), as Tunix's projections cast their float32 weights (and as
PyTorch's autocast runs a LoRA's matmuls in float16). Their gradients reach the float32
parameters through the cast, in float32. Where the two dtypes agree (float32 compute, or
parameters built in the compute dtype) nothing changes; a base op on weights qwix quantized
(QLoRA) is left as it is.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

OPS = ("einsum", "dot_general", "conv_general_dilated")  # LoraProvider's methods wrapped
READ = "_get_or_create_lora_params"  # where qwix's LoRA ops read a and b
MODULE = "qwix._src.providers.lora"
_MARK = "_lossscale_jax_compute_dtype"
_COMPUTE: contextvars.ContextVar[np.dtype | None] = contextvars.ContextVar(
    "lossscale_jax_lora_compute_dtype", default=None
)


def lora_module() -> Any:
    """qwix's LoRA module, or ``None`` where qwix is not installed."""
    try:
        import qwix._src.providers.lora as lora
    except ImportError:
        return None
    return lora


def missing() -> list[str]:
    """What :func:`install` needs of qwix and this qwix lacks (empty: all there)."""
    lora = lora_module()
    if lora is None:
        return [MODULE]
    names = [f"LoraProvider.{op}" for op in OPS if not hasattr(lora.LoraProvider, op)]
    if not hasattr(lora, READ):
        names.append(READ)
    return [f"{MODULE}.{name}" for name in names]


def install() -> bool:
    """Makes qwix's LoRA ops compute in their base op's dtype (once per process; see the
    module's docstring). Whether it was installed now (JAX's caches are cleared then: a trace
    made before would keep the old ops)."""
    lora = lora_module()
    if lora is None or missing() or getattr(getattr(lora, READ), _MARK, False):
        return False
    read = getattr(lora, READ)

    @functools.wraps(read)
    def read_in_compute_dtype(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        a, b = read(*args, **kwargs)
        want = _COMPUTE.get()
        if want is None:
            return a, b
        return tuple(_narrowed(x, want) for x in (a, b))

    setattr(read_in_compute_dtype, _MARK, True)
    setattr(lora, READ, read_in_compute_dtype)
    for name in OPS:
        setattr(lora.LoraProvider, name, _in_base_dtype(name, getattr(lora.LoraProvider, name)))
    jax.clear_caches()
    return True


def _narrowed(x: Any, want: np.dtype) -> Any:
    """``x`` cast to ``want`` where both are floating and ``want`` is narrower."""
    have = np.dtype(x.dtype)
    floating = jnp.issubdtype(have, jnp.floating) and jnp.issubdtype(want, jnp.floating)
    return x.astype(want) if floating and want.itemsize < have.itemsize else x


def _in_base_dtype(name: str, op: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(op)

    @functools.wraps(op)
    def in_base_dtype(self: Any, *args: Any, **kwargs: Any) -> Any:
        want = _base_dtype(name, signature.bind(self, *args, **kwargs).arguments)
        token = _COMPUTE.set(want)
        try:
            return op(self, *args, **kwargs)
        finally:
            _COMPUTE.reset(token)

    return in_base_dtype


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
