"""mpx's loss scale (``mpx/_loss_scaling.py``): ``DynamicLossScaling``, ``all_finite``, ``scaled``.

``DynamicLossScaling`` is an Equinox module with mpx's five fields, in mpx's order, all of
them leaves (``loss_scaling``, ``min_loss_scaling``, ``counter``, ``factor``, ``period``):
under ``eqx.filter_jit`` the arrays are traced and ``factor`` and ``period`` are static,
under ``jax.jit`` all five are traced, and ``eqx.tree_serialise_leaves`` writes what mpx
writes. Because the hyperparameters can be traced, ``adjust`` is mpx's rule on arrays, not
a policy (whose hyperparameters are static Python values); ``compat.mpx.import_state``
gives the policy that takes the same steps, for ``lsj.loss_scaling``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

T = TypeVar("T")

_F16_MAX = (2 - 2**-10) * 2**15  # float16's largest finite value, the cap of mpx's scale


def _concrete(value: Any) -> np.ndarray | None:
    """``value`` as a NumPy array when it has a value now (not a tracer), else ``None``."""
    if isinstance(value, jax.core.Tracer):
        return None
    if isinstance(value, bool | int | float | np.generic | np.ndarray | jax.Array):
        return np.asarray(value)
    return None


def _check_scale(name: str, value: Any, minimum: str) -> None:
    if not hasattr(value, "ndim") or not hasattr(value, "dtype"):
        raise TypeError(
            f"{name} must be a 0-d floating array, as mpx's, got {value!r}: write "
            f"jnp.asarray({value!r}, jnp.float32)."
        )
    if value.ndim != 0:
        raise ValueError(f"{name} must be a scalar (0-d array), got shape {value.shape}.")
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating array, got dtype {value.dtype}.")
    number = _concrete(value)
    if number is None:
        return
    ok = np.isfinite(number) and (number > 0 if minimum == "> 0" else number >= 0)
    if not ok:
        raise ValueError(f"{name} must be finite and {minimum}, got {float(number)!r}.")


def _check_number(name: str, value: Any, minimum: float, strict: bool) -> float | None:
    """A Python or array number for ``factor``/``period``: its value (``None`` if traced)."""
    if isinstance(value, bool | str) or value is None:
        raise TypeError(f"{name} must be a number, got {value!r}.")
    number = _concrete(value)
    if number is None:
        return None
    if number.shape != () or not np.issubdtype(number.dtype, np.number):
        raise TypeError(f"{name} must be a real scalar, got {value!r}.")
    if not (np.isfinite(number) and (number > minimum if strict else number >= minimum)):
        bound = f"{'>' if strict else '>='} {minimum:g}"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}.")
    return float(number)


class DynamicLossScaling(eqx.Module):
    """mpx's ``DynamicLossScaling``: its fields, arguments and methods, its arithmetic.

    Rule (``adjust(grads_finite)``, mpx's, every operation as mpx writes it)::

      if grads_finite:
          if counter == period - 1:
              loss_scaling = first_finite(loss_scaling * factor, loss_scaling)
      else:
          loss_scaling = max(min_loss_scaling, loss_scaling / factor)
      loss_scaling = clip(loss_scaling, min_loss_scaling, 65504)  # float16's largest
      counter = ((counter + 1) % period) * grads_finite

    ``scale(tree)`` multiplies every leaf by ``loss_scaling`` cast to float16, so a
    scale of ``2**16`` or more (65520 and up round to inf) scales the loss to inf: that
    step's gradients are not finite, it is skipped and the scale halves. ``adjust``
    never raises the scale past 65504, so only a starting scale can be that large.
    ``unscale(tree)`` multiplies every leaf by ``(1 / loss_scaling)`` in float32, giving
    float32 gradients. ``filter_grad`` and ``filter_value_and_grad`` unscale with the
    scale ``adjust`` returned, after the step's own check: on a growth step (every
    ``period``-th good step) the gradients come back divided by the grown scale, half
    (for ``factor=2``) of the true ones.

    Unlike mpx, arguments are checked when the object is built (mpx asserts the shapes
    only): ``loss_scaling`` and ``min_loss_scaling`` must be 0-d floating arrays (a
    Python number is refused, as by mpx), finite, ``> 0`` and ``>= 0``; ``factor`` a
    number ``> 1`` and ``period`` a whole number ``>= 1``; ``counter`` in
    ``[0, period)``. Traced values are not checked.

    Examples:
      >>> import jax.numpy as jnp
      >>> from lossscale_jax.compat import mpx
      >>> s = mpx.DynamicLossScaling(jnp.float32(2.0**14), jnp.float32(1.0), period=2)
      >>> s = s.adjust(jnp.array(True)).adjust(jnp.array(True))   # grows
      >>> float(s.loss_scaling), int(s.counter)
      (32768.0, 0)
      >>> float(s.adjust(jnp.array(True)).adjust(jnp.array(True)).loss_scaling)  # capped
      65504.0
      >>> float(s.adjust(jnp.array(False)).loss_scaling)
      16384.0
    """

    loss_scaling: jax.Array
    min_loss_scaling: jax.Array
    counter: jax.Array
    factor: int
    period: int

    def __init__(
        self,
        loss_scaling: jax.Array,
        min_loss_scaling: jax.Array,
        factor: int = 2,
        period: int = 2000,
        counter: jax.Array | None = None,
    ) -> None:
        _check_scale("loss_scaling", loss_scaling, "> 0")
        _check_scale("min_loss_scaling", min_loss_scaling, ">= 0")
        _check_number("factor", factor, 1.0, strict=True)
        steps = _check_number("period", period, 1.0, strict=False)
        if steps is not None and not steps.is_integer():
            raise ValueError(f"period must be a whole number, got {period!r}.")
        self.loss_scaling = loss_scaling
        self.min_loss_scaling = min_loss_scaling
        self.factor = factor
        self.period = period
        if counter is None:
            self.counter = jnp.zeros((), dtype=jnp.int32)
        else:
            count = _concrete(counter)
            if count is not None and (
                count.shape != ()
                or not np.issubdtype(count.dtype, np.integer)
                or not 0 <= int(count) < (steps if steps is not None else np.inf)
            ):
                raise ValueError(
                    f"counter must be an integer scalar in [0, period) = [0, {period}), "
                    f"got {counter!r}."
                )
            self.counter = counter

    def scale(self, tree: T) -> T:
        """Every leaf of ``tree`` times ``loss_scaling.astype(float16)``."""
        return jax.tree_util.tree_map(lambda x: x * self.loss_scaling.astype(jnp.float16), tree)

    def unscale(self, tree: T) -> T:
        """Every leaf of ``tree`` times ``(1 / loss_scaling).astype(float32)``."""
        inv_loss_scaling = 1 / self.loss_scaling
        inv_loss_scaling = inv_loss_scaling.astype(jnp.float32)
        return jax.tree_util.tree_map(lambda x: x * inv_loss_scaling, tree)

    def adjust(self, grads_finite: ArrayLike) -> DynamicLossScaling:
        """The loss scale after a step whose gradients were finite (a bool scalar) or not.

        Raises:
          ValueError: if ``grads_finite`` is not a scalar (mpx asserts it).
        """
        grads_finite = jnp.asarray(grads_finite)
        if grads_finite.ndim != 0:
            raise ValueError(
                f"grads_finite must be a boolean scalar, got shape {grads_finite.shape}."
            )

        def first_finite(a: jax.Array, b: jax.Array) -> jax.Array:
            return jax.lax.select(jnp.isfinite(a).all(), a, b)

        loss_scaling = jax.lax.select(
            grads_finite,
            jax.lax.select(
                self.counter == (self.period - 1),
                first_finite(self.loss_scaling * self.factor, self.loss_scaling),
                self.loss_scaling,
            ),
            jnp.maximum(self.min_loss_scaling, self.loss_scaling / self.factor),
        )
        loss_scaling = jnp.clip(loss_scaling, min=self.min_loss_scaling, max=_F16_MAX)
        counter = ((self.counter + 1) % self.period) * grads_finite
        return DynamicLossScaling(
            loss_scaling=loss_scaling,
            counter=counter,
            period=self.period,
            factor=self.factor,
            min_loss_scaling=self.min_loss_scaling,
        )


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every leaf of ``tree`` is finite (mpx's ``all_finite``).

    Rule (mpx's operations)::

      leaves = tree_leaves(tree)
      all(stack([all(isfinite(leaf)) for leaf in leaves])) if leaves else True

    mpx's formulation, not the library's one-pass check (``lsj.check_overflow``): both
    give the same flag, but in an mpx step the one-pass check changed how XLA:CPU compiled
    the Adam update around it, and Adam's state came out one ulp apart within a few steps.

    Examples:
      >>> import jax.numpy as jnp
      >>> from lossscale_jax.compat import mpx
      >>> bool(mpx.all_finite({"a": jnp.ones(2), "b": None})), bool(mpx.all_finite([]))
      (True, True)
      >>> bool(mpx.all_finite({"a": jnp.array([1.0, jnp.nan])}))
      False
    """
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves:
        return jnp.array(True)
    return jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]).all()


def scaled(
    func: Callable[..., Any], scaling: DynamicLossScaling, has_aux: bool = False
) -> Callable[..., Any]:
    """``func`` with its value multiplied by the loss scale (``scaling.scale``).

    Rule::

      has_aux: (value, aux) = func(...); return scaling.scale(value), aux
      else:    return scaling.scale(func(...))

    Examples:
      >>> import jax.numpy as jnp
      >>> from lossscale_jax.compat import mpx
      >>> s = mpx.DynamicLossScaling(jnp.float32(1024.0), jnp.float32(1.0))
      >>> float(mpx.scaled(lambda x: x * 2, s)(jnp.float32(0.5)))
      1024.0
    """

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if has_aux:
            value, aux = func(*args, **kwargs)
            return scaling.scale(value), aux
        return scaling.scale(func(*args, **kwargs))

    return wrapper
