"""The taps' public functions: ``tap``, ``recording``, ``discover``, ``value_and_grad``.

Re-exported by ``lossscale_jax.taps`` (its docstring tells the whole story).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from lossscale_jax.engine._hyper import check_argnums
from lossscale_jax.engine._tap_stats import TapStats
from lossscale_jax.errors import TapError
from lossscale_jax.taps._tapping import (
    Recorder,
    active,
    recorder,
    sinks_of,
    tap_tree,
    validate_modules,
)

#: Which modules are tapped: all (``True``), none (``False``), or those a predicate accepts.
Modules = bool | Callable[[Any], bool]


def tap(x: Any, name: str) -> Any:
    """Marks ``x`` (an array or a pytree of them) as a tap named ``name``.

    The identity in the forward pass. Inside ``recording`` (or ``value_and_grad``),
    the backward pass records the statistics of the cotangent arriving at ``x``
    (see ``TapStats``); elsewhere it does nothing at all. Several floating leaves
    become taps ``name[0]``, ``name[1]``, ...; a name met again in one pass gets
    ``#2``, ``#3``. Non-floating leaves pass through.

    Args:
      x: the value to mark.
      name: a non-empty string naming it in the statistics.

    Returns:
      ``x``.

    Raises:
      TypeError: if ``name`` is not a string, or ``x`` is an array that is not
        floating.
      errors.TapError: if ``name`` is empty, or the tap was not met when the sinks
        were made (``discover``).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import lossscale_jax as lsj
      >>> def loss_fn(w, x):
      ...     h = lsj.tap(jnp.tanh(x @ w), "hidden")
      ...     return jnp.sum(h) * 1e-6
      >>> loss, grads, taps = lsj.taps.value_and_grad(loss_fn)(jnp.ones((2, 3)), jnp.ones((4, 2)))
      >>> taps.names
      ('hidden',)
      >>> float(taps.max_abs()["hidden"])       # d loss / d h = 1e-6 everywhere
      9.999999974752427e-07
      >>> float(taps.underflow_fraction()["hidden"])   # below 2**-14: lost in float16
      1.0
    """
    if not isinstance(name, str):
        raise TypeError(f"tap name must be a str, got {name!r} ({type(name).__name__}).")
    if not name:
        raise TapError("tap name must be a non-empty string, got ''.")
    if hasattr(x, "dtype") and not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"lsj.tap({name!r}): only a floating array has a gradient to measure, got dtype "
            f"{x.dtype}."
        )
    return tap_tree(x, name)


@contextlib.contextmanager
def recording(
    sinks: TapStats | None,
    *,
    modules: Modules = True,
    model: Any = None,
    forward: bool = False,
    factors: Mapping[str, Any] | None = None,
) -> Iterator[None]:
    """Runs the code inside with its taps feeding ``sinks`` (use it inside the function
    you differentiate).

    ``jax.grad`` of that function with respect to ``sinks`` is the ``TapStats`` of the
    pass. ``value_and_grad`` does all of it for a function of arrays; write it out for
    an NNX model (``nnx.value_and_grad`` with ``argnums=(0, 1)`` over the model and
    the sinks) or a hand-written step.

    Args:
      sinks: the zero-valued ``TapStats`` ``discover`` made (``None`` only while
        ``discover`` traces the function).
      modules: tap every Flax Linen module's ``__call__`` output (by module path);
        ``False``: none; a predicate on module instances: those it accepts (e.g.
        ``lambda m: isinstance(m, Block)``; it also selects the NNX modules).
      model: an NNX module whose sub-modules (and itself) are tapped at their
        ``__call__`` output (by their path in ``model``); ``None``: no NNX tapping.
      forward: also record the forward activation's max and inf/nan entries
        (``diagnose`` does; a training step does not need them).
      factors: per tap name, a factor the tap multiplies the backward signal by after
        measuring it (per-layer scaling); ``None``: none.

    Raises:
      errors.TapError: if ``sinks`` is not a ``TapStats`` (outside ``discover``).
      TypeError: if ``modules`` or ``forward`` has the wrong type, or ``model`` is
        not an ``nnx.Module``.
    """
    select = validate_modules(modules)
    if not isinstance(forward, bool):
        raise TypeError(f"forward must be a bool, got {forward!r}.")
    outer = active()
    if outer is not None and outer.sinks is None:  # discover is tracing: collect the names
        rec = outer
    elif not isinstance(sinks, TapStats):
        raise TapError(
            f"recording needs the sinks lsj.taps.discover made (a TapStats), got "
            f"{type(sinks).__name__}."
        )
    else:
        rec = Recorder(sinks=sinks, forward=forward, factors=dict(factors) if factors else None)
    with recorder(rec, select, model):
        yield


def discover(
    fun: Callable[..., Any], *args: Any, modules: Modules = True, **kwargs: Any
) -> TapStats:
    """The sinks of the taps ``fun(*args, **kwargs)`` meets: one zero vector per tap.

    ``fun`` is traced abstractly once (``jax.eval_shape``: no computation) with every
    tap collecting its name; the result holds the names in forward order. Under
    ``jit`` this is one more trace of ``fun`` when the step is traced, nothing at run
    time. Pass ``None`` where ``fun`` takes the sinks.

    Args:
      fun: the function (it may call ``recording`` itself, as an NNX loss does).
      args: its positional arguments (arrays or shapes); keyword arguments are passed
        on too.
      modules: which Flax Linen modules to tap (as ``recording``).

    Returns:
      A ``TapStats`` of zeros (an empty one when ``fun`` meets no tap).
    """
    if not callable(fun):
        raise TypeError(f"fun must be callable, got {fun!r}.")
    rec = Recorder(sinks=None)
    with recorder(rec, validate_modules(modules), None):
        jax.eval_shape(fun, *args, **kwargs)
    return sinks_of(rec)


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    modules: Modules = True,
    factors: Mapping[str, Any] | None = None,
) -> Callable[..., tuple[Any, Any, TapStats]]:
    """``jax.value_and_grad`` that also returns the statistics of every tap.

    ``value_and_grad(fun)(*args)`` is ``(value, grads, taps)``: ``value`` and
    ``grads`` as ``jax.value_and_grad(fun, argnums, has_aux)`` gives them (``value``
    is ``(loss, aux)`` with ``has_aux``), ``taps`` a ``TapStats`` (the explicit
    ``lsj.tap`` calls, the Flax Linen modules, and the loss when ``fun`` calls
    ``lsj.scale_loss``). One trace of ``fun`` finds the taps, one differentiates.

    Args:
      fun: the loss function (the same one ``jax.value_and_grad`` would take).
      argnums: which positional arguments to differentiate (int or sequence).
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      modules: which Flax Linen modules to tap (as ``recording``).
      factors: per tap name, a float32 factor the tap multiplies the backward signal by
        (after measuring it): per-layer scaling (``lsj.layerwise.value_and_grad`` passes
        them); ``None``: none.

    Returns:
      A function of ``fun``'s arguments returning ``(value, grads, taps)``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> tx = lsj.loss_scaling(optax.sgd(0.1), lsj.HeadroomScale())
      >>> params = {"w": jnp.ones((2, 2))}                  # float32 master weights
      >>> opt_state = tx.init(params)
      >>> def loss_fn(p):                                   # a float16 loss
      ...     return lsj.scale_loss(jnp.sum(p["w"].astype(jnp.float16) ** 2), opt_state)
      >>> loss, grads, taps = lsj.taps.value_and_grad(loss_fn)(params)
      >>> taps.names                                        # the loss, tapped by scale_loss
      ('loss',)
      >>> updates, opt_state = tx.update(grads, opt_state, params, taps=taps)
    """
    if not callable(fun):
        raise TypeError(f"fun must be callable, got {fun!r}.")
    validate_modules(modules)
    single = isinstance(argnums, int)
    nums = check_argnums(argnums)

    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any, TapStats]:
        sinks = discover(fun, *args, modules=modules, **kwargs)

        missing = sorted(set(factors or ()) - set(sinks.names))
        if missing:
            raise TapError(
                f"factors name taps the function does not meet: {missing} (its taps: "
                f"{list(sinks.names)})."
            )

        def with_sinks(sinks: TapStats, *args: Any) -> Any:
            with recording(sinks, modules=modules, factors=factors):
                return fun(*args, **kwargs)

        shifted = (0,) + tuple(i + 1 for i in nums)
        value, grads = jax.value_and_grad(with_sinks, argnums=shifted, has_aux=has_aux)(
            sinks, *args
        )
        stats, rest = grads[0], grads[1:]
        stats = TapStats(stats.names, stats.dtypes, stats.values, tuple(factors or ()))
        return value, (rest[0] if single else rest), stats

    return wrapped
