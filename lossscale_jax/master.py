"""``master_weights``: float32 master copies of float16 (and bfloat16) parameters, kept in
the optimizer state, as DeepSpeed's FP16 optimizer and apex's O2 keep them."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from lossscale_jax.engine._nesting import prepare_inner
from lossscale_jax.engine._ops import where
from lossscale_jax.engine._opt_states import MasterWeightsState

__all__ = ["MasterWeightsState", "master_weights"]


def _narrow(p: Any) -> bool:
    """A floating parameter narrower than float32 (float16, bfloat16): it gets a master."""
    dtype = getattr(p, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


def master_weights(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Runs ``inner`` on float32 master copies of the float16 and bfloat16 parameters.

    For a model whose parameters are float16 (a float16 checkpoint, a Flax model with
    ``param_dtype=jnp.float16``): the optimizer's state, its arithmetic and the parameters
    it updates are float32, and the float16 parameters are the master copies rounded.

    Rule (one ``update``; ``p`` a float16/bfloat16 parameter, ``m`` its master)::

      m = m if m.astype(p.dtype) == p else p.astype(float32)    # per element: resynced
                                                                # where p was changed
      updates32, inner_state = inner.update(float32(grads), inner_state, masters)
      m = m + updates32                                         # float32
      updates = float32(m.astype(p.dtype)) - float32(p)         # what p must move by

    so that ``optax.apply_updates(params, updates)`` (``p + updates``, in float32, then
    rounded to ``p``'s dtype) lands on ``m`` rounded, bit for bit, wherever the new value's
    binary exponent is within 13 of the old one's (float16; 16 for bfloat16: their
    difference then fits float32's 24 bits) or either is zero (bfloat16 values under
    2**-100 aside: a float32 difference of theirs may be subnormal, which XLA:CPU flushes to
    zero). A step that changes a
    parameter by a factor of more than 2**13 lands where one float32 addition rounds it.
    float32 (and wider) parameters are their own masters: ``inner`` sees them and their
    gradients as they are, and their updates are ``inner``'s.

    Put it directly inside the loss scaling: ``lsj.loss_scaling(lsj.master_weights(inner),
    policy)``. The loss scaling then unscales the float16 gradients into float32 for it
    (never into float16, where they would underflow again), and stops warning that the
    inner optimizer runs in float16. The masters are part of the optimizer state: a
    checkpoint of it holds them, and parameters changed outside the optimizer (a restored
    checkpoint of the parameters alone) take over where they differ from the rounded
    masters.

    Args:
      inner: any Optax transformation (it sees float32 gradients and parameters).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a ``MasterWeightsState``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> params = {"w": jnp.array([1.0, 2.0], jnp.float16)}
      >>> tx = lsj.loss_scaling(lsj.master_weights(optax.sgd(1e-4)), lsj.StaticScale(8.0))
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.array([8.0, 8.0], jnp.float16)}        # scaled by 8
      >>> def step(params, state):
      ...     updates, state = tx.update(grads, state, params)
      ...     return optax.apply_updates(params, updates), state
      >>> params, state = step(params, state)   # -1e-4: under half a float16 ulp of 1 and 2
      >>> params["w"].tolist(), state.inner_state.master["w"].tolist()
      ([1.0, 2.0], [0.9998999834060669, 1.999899983406067])
      >>> for _ in range(2):
      ...     params, state = step(params, state)
      >>> params["w"].dtype, params["w"].tolist()   # the masters' -3e-4, rounded
      (dtype('float16'), [0.99951171875, 2.0])

    References:
      Micikevicius et al, `Mixed Precision Training
      <https://arxiv.org/abs/1710.03740>`_, 2018.
    """
    inner = prepare_inner(inner, "master_weights")

    def masters(params: Any, master: Any) -> Any:
        """The float32 parameters the inner sees: the masters, resynced to ``params``."""

        def leaf(p: Any, m: Any) -> Any:
            if m is None:
                return p
            fresh = p.astype(jnp.float32)
            return where(m.astype(p.dtype) == p, m, fresh)

        return jax.tree_util.tree_map(leaf, params, master, is_leaf=lambda x: x is None)

    def init_fn(params: optax.Params) -> MasterWeightsState:
        master = jax.tree_util.tree_map(
            lambda p: p.astype(jnp.float32) if _narrow(p) else None, params
        )
        return MasterWeightsState(master, inner.init(masters(params, master)))

    def update_fn(
        updates: optax.Updates,
        state: MasterWeightsState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, MasterWeightsState]:
        if params is None:
            raise ValueError(
                "master_weights needs params: call update(grads, state, params) (it updates "
                "the masters and returns what moves the parameters onto them)."
            )
        if not isinstance(state, MasterWeightsState):
            raise TypeError(
                "state must be the MasterWeightsState made by master_weights' init, got "
                f"{type(state).__name__}."
            )
        full = masters(params, state.master)

        def wide(g: Any, m: Any) -> Any:
            return g.astype(m.dtype) if _narrow(g) and jnp.issubdtype(m.dtype, jnp.floating) else g

        grads = jax.tree_util.tree_map(wide, updates, full)
        inner_updates, inner_state = inner.update(grads, state.inner_state, full, **extra_args)
        new_full = optax.apply_updates(full, inner_updates)

        def moved(p: Any, m: Any, new: Any, u: Any) -> Any:
            if m is None:
                return u
            return new.astype(p.dtype).astype(jnp.float32) - p.astype(jnp.float32)

        new_updates = jax.tree_util.tree_map(
            moved, params, state.master, new_full, inner_updates, is_leaf=lambda x: x is None
        )
        new_master = jax.tree_util.tree_map(
            lambda m, new: None if m is None else new,
            state.master,
            new_full,
            is_leaf=lambda x: x is None,
        )
        return new_updates, MasterWeightsState(new_master, inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
