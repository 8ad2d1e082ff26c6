"""jmp's loss-scale objects (``jmp/_src/loss_scale.py``): the dynamic one stepped by a policy.

``DynamicLossScale``, ``StaticLossScale`` and ``NoOpLossScale`` have jmp's fields and
methods (``scale``, ``unscale``, ``adjust``, ``loss_scale``); ``all_finite`` and
``select_tree`` are jmp's functions. A jmp program runs with ``compat.jmp`` in place of
``jmp``, compiling to jmp's program where the bits depend on it: ``select_tree`` is jmp's
select per leaf, and the static and no-op scales are empty pytrees as in jmp.
``DynamicLossScale.adjust`` is the policy of ``compat.jmp.dynamic_loss_scale_policy``
(``loss_scale`` is its ``scale``, ``counter`` its ``growth_count``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, TypeVar

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from lossscale_jax import numerics, policies
from lossscale_jax.compat._common import _INF, _TINY, _build, _number, _whole
from lossscale_jax.engine._state import initial_state
from lossscale_jax.policies import LossScaleState, NoScale, StaticScale

T = TypeVar("T")
_NUMBERS = (bool, int, float, np.generic)


@dataclasses.dataclass(frozen=True)
class _JmpDynamicLossScale(policies.DynamicScale):
    """``DynamicScale`` whose ``init()`` starts at jmp's ``counter``."""

    counter: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.counter < self.growth_interval:
            raise ValueError(
                f"counter must be in [0, period) = [0, {self.growth_interval}), got "
                f"{self.counter!r}."
            )

    def init(self) -> LossScaleState:
        return super().init().replace(growth_count=jnp.asarray(self.counter, jnp.int32))


def dynamic_loss_scale_policy(
    loss_scale: Any,
    counter: Any = 0,
    period: int = 2000,
    factor: float = 2,
    min_loss_scale: Any = 1.0,
) -> policies.DynamicScale:
    """jmp's ``DynamicLossScale`` rule as a policy, with jmp's positional order.

    Rule (``DynamicLossScale.adjust``)::

      if grads_finite:
          if counter == period - 1:
              loss_scale = first_finite(loss_scale * factor, loss_scale)
          counter = (counter + 1) % period
      else:
          loss_scale = max(min_loss_scale, loss_scale / factor); counter = 0

    ``counter`` is where the policy's ``init()`` starts counting (jmp's
    second field; 0 for a new run). Unlike jmp, ``min_loss_scale`` survives
    ``jit`` (jmp's pytree flattening drops it and falls back to 1), and
    ``min_loss_scale=0`` (no floor in jmp) stops at ``2**-126``. jmp divides
    by ``factor``; here the scale is multiplied by ``1 / factor``, the same
    float32 number for power-of-two factors (the default 2).

    Args:
      loss_scale: the starting scale (a number or 0-d array).
      counter: good steps already counted, in ``[0, period)``.
      period: good steps before a growth (an int, or a whole float as jmp
        accepts).
      factor: growth factor (> 1); the backoff divides by it.
      min_loss_scale: floor of the scale (>= 0; 0 means none).

    Returns:
      A ``DynamicScale``.

    Raises:
      ValueError: for ``factor <= 1``, ``min_loss_scale < 0``, a ``period`` that is not a
        whole number >= 1, or ``counter`` outside ``[0, period)``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from lossscale_jax import compat
      >>> p = compat.jmp.dynamic_loss_scale_policy(jnp.float32(10), jnp.int32(3), 5., 2)
      >>> p.growth_interval, int(p.init().growth_count)
      (5, 3)
    """
    f = _number("factor", factor)
    if not f > 1.0:
        raise ValueError(f"factor must be > 1, got {factor!r}.")
    floor = _number("min_loss_scale", min_loss_scale)
    if floor < 0.0:
        raise ValueError(f"min_loss_scale must be >= 0, got {min_loss_scale!r}.")
    count = _whole("counter", counter)
    return _build(
        _JmpDynamicLossScale,
        {
            "init_scale": "loss_scale",
            "growth_interval": "period",
            "min_scale": "min_loss_scale",
            "growth_factor": "factor",
        },
        init_scale=_number("loss_scale", loss_scale),
        growth_factor=f,
        backoff_factor=1.0 / f,
        growth_interval=_whole("period", period),
        min_scale=max(floor, _TINY),
        max_scale=_INF,
        counter=count,
    )


def static_loss_scale_policy(loss_scale: Any) -> StaticScale:
    """jmp's ``StaticLossScale`` as a policy: a fixed scale (overflowing steps are skipped).

    Examples:
      >>> from lossscale_jax import compat
      >>> float(compat.jmp.static_loss_scale_policy(128.0).init().scale)
      128.0
    """
    return _build(StaticScale, {"scale": "loss_scale"}, scale=_number("loss_scale", loss_scale))


def no_op_loss_scale_policy() -> NoScale:
    """jmp's ``NoOpLossScale`` as a policy: no scaling.

    Examples:
      >>> from lossscale_jax import compat
      >>> float(compat.jmp.no_op_loss_scale_policy().init().scale)
      1.0
    """
    return NoScale()


def _as(value: Any, dtype: Any) -> Any:
    """A Python or NumPy number as a 0-d array of ``dtype``; arrays and placeholders as they are."""
    return jnp.asarray(value, dtype) if isinstance(value, _NUMBERS) else value


def _concrete(value: Any, placeholder: Any) -> Any:
    """``value`` if it is a number or an array with a value, else ``placeholder``."""
    if isinstance(value, (*_NUMBERS, np.ndarray)) or (
        isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer)
    ):
        return value
    return placeholder


def _flag(grads_finite: ArrayLike) -> jax.Array:
    flag = jnp.asarray(grads_finite)
    if flag.ndim != 0:
        raise ValueError(f"grads_finite must be a boolean scalar, got shape {flag.shape}.")
    return flag.astype(jnp.bool_)


def _register_empty_pytree(cls: type) -> None:
    """jmp's ``register_empty_pytree``: no leaves, the object itself the static data."""
    jax.tree_util.register_pytree_node(cls, lambda x: ((), x), lambda x, _: x)


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """jmp's ``NoOpLossScale``: scale 1, ``scale``/``unscale`` return the tree itself."""

    @property
    def loss_scale(self) -> int:
        """1."""
        return 1

    def scale(self, tree: T) -> T:
        """``tree`` itself."""
        return tree

    def unscale(self, tree: T) -> T:
        """``tree`` itself."""
        return tree

    def adjust(self, grads_finite: ArrayLike) -> NoOpLossScale:
        """This object: nothing to adjust."""
        del grads_finite
        return self


_register_empty_pytree(NoOpLossScale)


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """jmp's ``StaticLossScale``: scales and unscales by a fixed ``loss_scale``.

    As in jmp, the object is an empty pytree (the object itself is its treedef's
    static data): inside ``jit`` ``loss_scale`` is a compile-time constant, kept as
    given (a Python number multiplies a float16 tree in float16), and a new value
    compiles anew. That is what makes a jmp program bit-identical with this import:
    XLA folds a constant into the arithmetic around it (``1 / loss_scale`` first), and
    a traced scale gives another compiled program, which rounded Adam's state
    differently in the last bit. ``compat.jmp.static_loss_scale_policy`` with
    ``lsj.loss_scaling`` keeps the scale in the state instead (no recompiles).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from lossscale_jax.compat import jmp
      >>> ls = jmp.StaticLossScale(jnp.float32(128.0))
      >>> jax.tree_util.tree_leaves(ls)
      []
      >>> float(ls.unscale(ls.scale(jnp.float16(3.0))))
      3.0
    """

    loss_scale: Any

    def scale(self, tree: T) -> T:
        """Every leaf of ``tree`` times ``loss_scale``."""
        return jax.tree_util.tree_map(lambda x: x * self.loss_scale, tree)

    def unscale(self, tree: T) -> T:
        """Every leaf of ``tree`` times ``1 / loss_scale``."""
        inv_loss_scale = 1 / self.loss_scale
        return jax.tree_util.tree_map(lambda x: x * inv_loss_scale, tree)

    def adjust(self, grads_finite: ArrayLike) -> StaticLossScale:
        """This object: a static scale does not move."""
        del grads_finite
        return self


_register_empty_pytree(StaticLossScale)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["loss_scale", "counter"],
    meta_fields=["period", "factor", "min_loss_scale"],
)
@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """jmp's ``DynamicLossScale``: jmp's fields, positional order and methods.

    Rule (``adjust(grads_finite)``; the policy of ``dynamic_loss_scale_policy``)::

      if grads_finite:
          if counter == period - 1:
              loss_scale = first_finite(loss_scale * factor, loss_scale)
          counter = (counter + 1) % period
      else:
          loss_scale = max(min_loss_scale, loss_scale / factor); counter = 0

    ``scale(tree)`` multiplies every leaf by ``loss_scale``; ``unscale(tree)``
    multiplies by ``1 / loss_scale``. Numbers become float32 (``loss_scale``)
    and int32 (``counter``) arrays; arrays are kept as given. Unlike jmp,
    ``min_loss_scale`` survives ``jit`` (a static field here; jmp drops it and
    falls back to 1) and a floor of 0 stops at ``2**-126``; the backoff
    multiplies by ``1 / factor``, the same float32 number as jmp's division for
    power-of-two factors (the default 2).

    Examples:
      >>> import jax.numpy as jnp
      >>> from lossscale_jax.compat import jmp
      >>> ls = jmp.DynamicLossScale(jnp.float32(2.0**15), period=2)
      >>> ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))
      >>> float(ls.loss_scale), int(ls.counter)
      (65536.0, 0)
      >>> float(ls.adjust(jnp.array(False)).loss_scale)
      32768.0
    """

    loss_scale: Any
    counter: Any = 0
    period: int = 2000
    factor: float = 2
    min_loss_scale: Any = 1.0

    def __post_init__(self) -> None:
        # Checks every argument, naming it (values JAX builds the pytree with pass).
        floor = _number("min_loss_scale", self.min_loss_scale)
        dynamic_loss_scale_policy(
            _concrete(self.loss_scale, max(floor, 1.0)),
            _concrete(self.counter, 0),
            self.period,
            self.factor,
            self.min_loss_scale,
        )
        object.__setattr__(self, "loss_scale", _as(self.loss_scale, jnp.float32))
        object.__setattr__(self, "counter", _as(self.counter, jnp.int32))
        object.__setattr__(self, "min_loss_scale", floor)

    @property
    def _policy(self) -> policies.DynamicScale:
        start = max(float(self.min_loss_scale), 1.0)
        return dynamic_loss_scale_policy(start, 0, self.period, self.factor, self.min_loss_scale)

    @property
    def policy(self) -> policies.DynamicScale:
        """The rule as a policy (``dynamic_loss_scale_policy``), for ``lsj.loss_scaling``."""
        return dynamic_loss_scale_policy(
            self.loss_scale, self.counter, self.period, self.factor, self.min_loss_scale
        )

    def scale(self, tree: T) -> T:
        """Every leaf of ``tree`` times ``loss_scale``."""
        return jax.tree_util.tree_map(lambda x: x * self.loss_scale, tree)

    def unscale(self, tree: T) -> T:
        """Every leaf of ``tree`` times ``1 / loss_scale``."""
        inv_loss_scale = 1 / self.loss_scale
        return jax.tree_util.tree_map(lambda x: x * inv_loss_scale, tree)

    def adjust(self, grads_finite: ArrayLike) -> DynamicLossScale:
        """The next loss scale, after a step whose gradients were finite or not."""
        finite = _flag(grads_finite)
        state = initial_state(self.loss_scale).replace(
            growth_count=jnp.asarray(self.counter, jnp.int32)
        )
        new = self._policy.adjust(state, jnp.logical_not(finite))
        return dataclasses.replace(self, loss_scale=new.scale, counter=new.growth_count)


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every leaf of ``tree`` is finite (jmp's ``all_finite``).

    One pass over the floating leaves (``numerics.check_overflow``); non-floating
    leaves count as finite, an empty tree is finite.
    """
    return jnp.logical_not(numerics.check_overflow(tree, "ieee"))


def select_tree(pred: ArrayLike, a: T, b: T) -> T:
    """``a`` if ``pred`` else ``b``, for two trees of one structure (jmp's ``select_tree``).

    Rule::

      jax.tree_util.tree_map(functools.partial(jax.lax.select, pred), a, b)

    jmp's own formulation, one select per leaf: the leaves of ``a`` and ``b``
    must match in shape and dtype (``TypeError`` from ``lax.select`` otherwise),
    the trees in structure (``ValueError`` from ``tree_map``). Not a ``lax.cond``,
    which selects the same values but changes how XLA fuses the computation of
    ``a`` (an Adam step), and with it the rounding of its last bit. For speed,
    ``lsj.loss_scaling`` takes the skip as one decision chosen per backend.

    Raises:
      ValueError: if ``pred`` is not a boolean scalar (jmp asserts it).
    """
    pred = jnp.asarray(pred)
    if pred.ndim != 0 or pred.dtype != jnp.bool_:
        raise ValueError(f"pred must be a boolean scalar, got {pred.dtype}{list(pred.shape)}.")
    return jax.tree_util.tree_map(functools.partial(jax.lax.select, pred), a, b)


LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale
