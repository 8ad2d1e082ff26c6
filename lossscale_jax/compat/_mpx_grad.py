"""mpx's gradient tools (``mpx/_grad_tools.py``): the scaled gradient and the guarded update.

``filter_value_and_grad`` and ``filter_grad`` are Equinox's, with the arguments cast to
half precision, the loss scaled, and the gradients checked, the scale adjusted and the
gradients unscaled, in that order (mpx's); ``optimizer_update`` applies an Optax update and
keeps the old model and optimizer state where the gradients were not finite, with mpx's
one ``lax.select`` per array leaf.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from lossscale_jax.compat._mpx_cast import cast_to_full_precision, cast_to_half_precision
from lossscale_jax.compat._mpx_scale import DynamicLossScaling, all_finite, scaled

T = TypeVar("T")


def select_tree(pred: ArrayLike, a: T, b: T) -> T:
    """``a`` where ``pred`` else ``b``, leaf by leaf; a leaf that is not an array comes from ``a``.

    Rule::

      tree_map(lambda x, y: lax.select(pred, x, y) if eqx.is_array(x) else x, a, b)

    Raises:
      ValueError: if ``pred`` is not a boolean scalar (mpx asserts it).

    Examples:
      >>> import jax.numpy as jnp
      >>> from lossscale_jax.compat import mpx
      >>> out = mpx.select_tree(jnp.array(False), (jnp.ones(2), "new"), (jnp.zeros(2), "old"))
      >>> out[0].tolist(), out[1]
      ([0.0, 0.0], 'new')
    """
    pred = jnp.asarray(pred)
    if pred.ndim != 0 or pred.dtype != jnp.bool_:
        raise ValueError(f"pred must be a boolean scalar, got {pred.dtype}{list(pred.shape)}.")

    def select_leaf(x1: Any, x2: Any) -> Any:
        return jax.lax.select(pred, x1, x2) if eqx.is_array(x1) else x1

    return jax.tree_util.tree_map(select_leaf, a, b)


def _cast_arguments(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    args_cast = tuple(cast_to_half_precision(x) for x in args)
    kwargs_cast = {k: cast_to_half_precision(v) for k, v in kwargs.items()}
    return args_cast, kwargs_cast


def filter_grad(
    func: Callable[..., Any],
    scaling: DynamicLossScaling,
    has_aux: bool = False,
    use_mixed_precision: bool = True,
) -> Callable[..., Any]:
    """``eqx.filter_grad`` of ``func`` in half precision, with loss scaling (mpx's).

    Rule (the returned function, called like ``func``; ``use_mixed_precision=True``)::

      args = cast_to_half_precision(args)            # and kwargs
      grads = eqx.filter_grad(scaled(func, scaling))(*args)
      grads_finite = all_finite(grads)
      scaling = scaling.adjust(grads_finite)         # the new scale...
      grads = scaling.unscale(grads)                 # ...unscales: float32 gradients
      return scaling, grads_finite, grads            # (..., aux) with has_aux

    Unscaled with the adjusted scale: on a growth step the gradients are divided by the
    grown scale. With ``use_mixed_precision=False``: no cast, no scale, ``grads_finite``
    is ``True`` and ``scaling`` comes back unchanged (the gradients in float32 without
    ``has_aux``).

    Returns:
      The function computing ``(scaling, grads_finite, grads)``, and ``aux`` last with
      ``has_aux``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from lossscale_jax.compat import mpx
      >>> s = mpx.DynamicLossScaling(jnp.float32(1024.0), jnp.float32(1.0))
      >>> s, finite, g = mpx.filter_grad(lambda w: jnp.sum(w**2), s)(jnp.ones(2))
      >>> bool(finite), g.tolist(), g.dtype
      (True, [2.0, 2.0], dtype('float32'))
    """

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if use_mixed_precision:
            args_cast, kwargs_cast = _cast_arguments(args, kwargs)
            func_scaled = scaled(func, scaling, has_aux=has_aux)
        else:
            args_cast, kwargs_cast = args, kwargs
            func_scaled = func
        dfunc_scaled = eqx.filter_grad(func_scaled, has_aux=has_aux)
        if has_aux:
            grad, aux = dfunc_scaled(*args_cast, **kwargs_cast)
            if use_mixed_precision:
                grads_finite = all_finite(grad)
                loss_scaling_new = scaling.adjust(grads_finite)
                grad = loss_scaling_new.unscale(grad)
            else:
                grads_finite = jnp.bool_(True)
                loss_scaling_new = scaling
            return loss_scaling_new, grads_finite, grad, aux
        grad = cast_to_full_precision(dfunc_scaled(*args_cast, **kwargs_cast))
        if use_mixed_precision:
            grads_finite = all_finite(grad)
            loss_scaling_new = scaling.adjust(grads_finite)
            grad = loss_scaling_new.unscale(grad)
        else:
            grads_finite = jnp.bool_(True)
            loss_scaling_new = scaling
        return loss_scaling_new, grads_finite, grad

    return wrapper


def calculate_scaled_grad(
    func: Callable[..., Any],
    scaling: DynamicLossScaling,
    has_aux: bool = False,
    use_mixed_precision: bool = True,
) -> Callable[..., Any]:
    """``eqx.filter_value_and_grad`` of the scaled ``func`` on half-precision arguments.

    Rule::

      (scaled value, grads) = eqx.filter_value_and_grad(scaled(func, scaling))(
          *cast_to_half_precision(args))                # nothing unscaled or checked

    With ``use_mixed_precision=False``: ``eqx.filter_value_and_grad(func)(*args)``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from lossscale_jax.compat import mpx
      >>> s = mpx.DynamicLossScaling(jnp.float32(1024.0), jnp.float32(1.0))
      >>> value, g = mpx.calculate_scaled_grad(jnp.sum, s)(jnp.ones(2))
      >>> float(value), g.tolist(), g.dtype
      (2048.0, [1024.0, 1024.0], dtype('float16'))
    """

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if use_mixed_precision:
            args_cast, kwargs_cast = _cast_arguments(args, kwargs)
            func_scaled = scaled(func, scaling, has_aux=has_aux)
        else:
            args_cast, kwargs_cast = args, kwargs
            func_scaled = func
        return eqx.filter_value_and_grad(func_scaled, has_aux=has_aux)(*args_cast, **kwargs_cast)

    return wrapper


def filter_value_and_grad(
    func: Callable[..., Any],
    scaling: DynamicLossScaling,
    has_aux: bool = False,
    use_mixed_precision: bool = True,
) -> Callable[..., Any]:
    """``eqx.filter_value_and_grad`` of ``func`` in half precision, with loss scaling (mpx's).

    Rule (the returned function, called like ``func``; ``use_mixed_precision=True``)::

      (value, grads) = calculate_scaled_grad(func, scaling)(*args)   # scaled, half precision
      grads_finite = all_finite(grads)
      scaling = scaling.adjust(grads_finite)         # the new scale...
      grads = scaling.unscale(grads)                 # ...unscales the gradients
      value = scaling.unscale(value)                 # ...and the value, in float32
      return value, scaling, grads_finite, grads     # (value, aux) first with has_aux

    Unscaled with the adjusted scale: on a growth step the value and the gradients are
    divided by the grown scale (half the true ones for ``factor=2``). With
    ``use_mixed_precision=False``: Equinox's value and gradients, ``grads_finite`` ``True``
    and ``scaling`` unchanged.

    Returns:
      The function computing ``(value, scaling, grads_finite, grads)``, with
      ``(value, aux)`` in the first place with ``has_aux``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from lossscale_jax.compat import mpx
      >>> s = mpx.DynamicLossScaling(jnp.float32(1024.0), jnp.float32(1.0), period=1)
      >>> loss, s, finite, g = mpx.filter_value_and_grad(jnp.sum, s)(jnp.ones(2))
      >>> float(s.loss_scaling), float(loss), g.tolist()   # a growth step: halved
      (2048.0, 1.0, [0.5, 0.5])
    """

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        dfunc_scaled = calculate_scaled_grad(
            func, scaling=scaling, has_aux=has_aux, use_mixed_precision=use_mixed_precision
        )
        aux = None
        if has_aux:
            (value, aux), grad = dfunc_scaled(*args, **kwargs)
        else:
            value, grad = dfunc_scaled(*args, **kwargs)
        if use_mixed_precision:
            grads_finite = all_finite(grad)
            loss_scaling_new = scaling.adjust(grads_finite)
            grad = loss_scaling_new.unscale(grad)
            value = loss_scaling_new.unscale(value)
        else:
            grads_finite = jnp.bool_(True)
            loss_scaling_new = scaling
        if has_aux:
            return (value, aux), loss_scaling_new, grads_finite, grad
        return value, loss_scaling_new, grads_finite, grad

    return wrapper


def optimizer_update(
    model: Any,
    optimizer: optax.GradientTransformation,
    optimizer_state: Any,
    grads: Any,
    grads_finite: ArrayLike,
) -> tuple[Any, Any]:
    """One Optax step on an Equinox model, kept only where ``grads_finite`` (mpx's).

    Rule::

      updates, new_state = optimizer.update(grads, optimizer_state,
                                            eqx.filter(model, eqx.is_array))
      new_model = eqx.apply_updates(model, updates)
      return (select_tree(grads_finite, new_model, model),
              select_tree(grads_finite, new_state, optimizer_state))

    The update is computed on every step and selected leaf by leaf (mpx's formulation;
    ``lsj.apply_gradients`` skips it with one decision instead). A leaf that is not an
    array (an activation function, a Python number) comes from the new model.

    Returns:
      ``(model, optimizer_state)``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from lossscale_jax.compat import mpx
      >>> model, opt = {"w": jnp.ones(2)}, optax.sgd(0.5)
      >>> grads = {"w": jnp.array([jnp.inf, 1.0])}
      >>> new, _ = mpx.optimizer_update(model, opt, opt.init(model), grads, jnp.array(False))
      >>> new["w"].tolist()                                  # skipped: unchanged
      [1.0, 1.0]
    """
    updates, new_optimizer_state = optimizer.update(
        grads, optimizer_state, eqx.filter(model, eqx.is_array)
    )
    new_model = eqx.apply_updates(model, updates)
    finite = jnp.asarray(grads_finite)
    return (
        select_tree(finite, new_model, model),
        select_tree(finite, new_optimizer_state, optimizer_state),
    )
