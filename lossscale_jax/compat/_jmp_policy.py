"""jmp's mixed-precision policies (``jmp/_src/policy.py``): which dtype holds what.

``get_policy("p=f32,c=f16,o=f32")`` parses jmp's policy strings into a ``Policy`` whose
``cast_to_param``/``cast_to_compute``/``cast_to_output`` cast the floating leaves of a
tree; ``cast_to_full``, ``cast_to_half`` and ``half_dtype`` as in jmp.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")

_NAMES: dict[Any, tuple[str, ...]] = {
    jnp.bfloat16: ("bf16", "bfloat16"),
    jnp.float16: ("f16", "float16"),
    jnp.float32: ("full", "f32", "float32"),
    jnp.float64: ("f64", "float64"),
}
_DTYPES = {name: dtype for dtype, names in _NAMES.items() for name in names}
_KEYS = {"p": "param_dtype", "params": "param_dtype", "c": "compute_dtype"}
_KEYS |= {"compute": "compute_dtype", "o": "output_dtype", "output": "output_dtype"}


def half_dtype() -> Any:
    """bfloat16 on a TPU, float16 elsewhere (the platform of the first local device)."""
    return jnp.bfloat16 if jax.local_devices()[0].platform == "tpu" else jnp.float16


def _cast_floating_to(tree: T, dtype: Any) -> T:
    def cast(x: Any) -> Any:
        if isinstance(x, np.ndarray | jax.Array) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree_util.tree_map(cast, tree)


def cast_to_full(tree: T) -> T:
    """The floating array leaves of ``tree`` in float32 (other leaves as they are)."""
    return _cast_floating_to(tree, jnp.float32)


def cast_to_half(tree: T) -> T:
    """The floating array leaves of ``tree`` in ``half_dtype()``."""
    return _cast_floating_to(tree, half_dtype())


def _parse_dtype(value: str) -> Any:
    if value == "half":
        return half_dtype()
    if value not in _DTYPES:
        raise ValueError(
            f"Unknown dtype {value!r}: use full, half, float16, bfloat16, float32, float64 or "
            "a short name (f16, bf16, f32, f64)."
        )
    return _DTYPES[value]


@dataclasses.dataclass(frozen=True)
class Policy:
    """jmp's ``Policy``: the dtypes of parameters, computation and outputs.

    Examples:
      >>> import jax.numpy as jnp
      >>> from lossscale_jax.compat import jmp
      >>> policy = jmp.get_policy("p=f32,c=f16,o=f32")
      >>> policy.cast_to_compute({"w": jnp.ones(2)})["w"].dtype
      dtype('float16')
      >>> str(policy)
      'p=full,c=f16,o=full'
    """

    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any

    def cast_to_param(self, x: T) -> T:
        """The floating leaves of ``x`` in ``param_dtype``."""
        return _cast_floating_to(x, self.param_dtype)

    def cast_to_compute(self, x: T) -> T:
        """The floating leaves of ``x`` in ``compute_dtype``."""
        return _cast_floating_to(x, self.compute_dtype)

    def cast_to_output(self, x: T) -> T:
        """The floating leaves of ``x`` in ``output_dtype``."""
        return _cast_floating_to(x, self.output_dtype)

    def with_output_dtype(self, output_dtype: Any) -> Policy:
        """This policy with another ``output_dtype``."""
        return dataclasses.replace(self, output_dtype=output_dtype)

    def __str__(self) -> str:
        short = [_NAMES[d][0] for d in (self.param_dtype, self.compute_dtype, self.output_dtype)]
        return "p={},c={},o={}".format(*short)


def get_policy(policy_name: str) -> Policy:
    """A ``Policy`` from jmp's strings: ``"c=f16"``, ``"p=f32,c=bf16,o=f32"``, ``"half"``.

    Unnamed parts default as in jmp: params float32, compute as params,
    output as compute; a bare dtype name sets all three.
    """
    if not isinstance(policy_name, str):
        raise TypeError(f"policy_name must be a str, got {policy_name!r}.")
    if "=" not in policy_name:
        dtype = _parse_dtype(policy_name)
        return Policy(dtype, dtype, dtype)
    found: dict[str, Any] = {"param_dtype": jnp.float32}
    for part in policy_name.split(","):
        key, _, value = part.partition("=")
        if key not in _KEYS:
            raise ValueError(
                f"Unknown key {key!r} in {policy_name!r}: use 'params', 'compute' or 'output' "
                "(or 'p', 'c', 'o')."
            )
        found[_KEYS[key]] = _parse_dtype(value)
    compute = found.get("compute_dtype", found["param_dtype"])
    return Policy(found["param_dtype"], compute, found.get("output_dtype", compute))
