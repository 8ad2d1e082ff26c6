"""Reading and changing the loss-scale state inside an optimizer state.

``get_loss_scale_state`` finds it (refusing unsafe nestings, see ``_nesting``),
``set_loss_scale_state`` puts another in, ``switch_policy`` moves it under another
policy, ``scale_loss`` multiplies the loss by its scale.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from lossscale_jax.engine import _loss_note, _wiring
from lossscale_jax.engine._check import at_least_float32
from lossscale_jax.engine._nesting import locate
from lossscale_jax.engine._policy import LossScalePolicy, check_policy
from lossscale_jax.engine._state import LossScaleState, is_loss_scale_state
from lossscale_jax.taps._tapping import tap_array


def get_loss_scale_state(opt_state: Any) -> LossScaleState:
    """Finds the one ``LossScaleState`` in an optimizer state, refusing unsafe nestings.

    Rule (the path from the root of ``opt_state`` to its ``LossScaleState``)::

      LossScalingState / LossScalingMultiStepsState  -> its loss_scale: fine
      a tuple of one element (optax.chain(loss_scaling(...)))      : fine
      your own containers (dict, list, dataclass, ...)              : fine
      a tuple of several (optax.chain with other transformations)   : ValueError
      any optax wrapper state (MultiSteps, inject_hyperparams,
        masked, multi_transform, apply_if_finite, ...)               : ValueError

    A wrapper outside loss scaling sees the scaled gradients (inf included)
    or runs on skipped steps; each error names the problem and the nesting
    that works (the wrapper inside ``loss_scaling``, or
    ``loss_scaling_multi_steps`` for accumulation). ``scale_loss``,
    ``metrics``, ``switch_policy``, ``TrainState.create`` and
    ``LossScaleOptimizer`` all read the state through it.

    Args:
      opt_state: an optimizer state, or a ``LossScaleState``.

    Returns:
      The ``LossScaleState``.

    Raises:
      ValueError: if ``opt_state`` holds no ``LossScaleState``, more than one,
        or one inside a refused nesting.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> tx = lsj.loss_scaling(optax.adam(1e-3), lsj.StaticScale(8.0))
      >>> float(lsj.get_loss_scale_state(tx.init({"w": jnp.zeros(2)})).scale)
      8.0
      >>> wrapped = optax.MultiSteps(tx, every_k_schedule=2)
      >>> try:
      ...     lsj.get_loss_scale_state(wrapped.init({"w": jnp.zeros(2)}))
      ... except ValueError as e:
      ...     print(str(e)[:60])
      lossscale_jax.loss_scaling is wrapped in optax.MultiSteps: i
    """
    return locate(opt_state)[0]


def switch_policy(opt_state: Any, policy: LossScalePolicy) -> Any:
    """Moves the loss-scale state inside ``opt_state`` to where ``policy`` keeps it.

    For a mid-run change of policy (a lower static scale, a raised
    ``min_scale``) or a checkpoint resumed under another policy: call it on
    the state before the next ``scale_loss``, with the transformation rebuilt
    around the new policy, so the next step's gradients are already scaled by
    the new policy's scale.

    Rule::

      loss_scale = policy.conform(loss_scale)
        # StaticScale(s): scale = s; NoScale: 1;
        # DynamicScale / TolerantDynamicScale: clip(scale, min_scale, max_scale)
        # if the scale moved: growth_count = hysteresis_count = 0
        # kept: the telemetry (total_steps, overflow_steps, skipped_steps), the flags
        # policy_state: the new policy's (fresh unless the state already holds one like it)
      everything else in opt_state is returned as it is

    The growth and hysteresis counters count from the last change of the
    scale, so they restart when it moves (as after any backoff or growth) and
    are kept when it does not: a dynamic run continues where it was.

    Args:
      opt_state: an optimizer state holding one ``LossScaleState`` (as
        ``get_loss_scale_state`` reads it), or a ``LossScaleState``.
      policy: the policy to continue with.

    Returns:
      ``opt_state`` with the ``LossScaleState`` replaced: the same structure, but for
      ``policy_state`` when the two policies keep different states of their own (the
      structure ``policy``'s ``init`` gives, as the rebuilt transformation expects).

    Raises:
      errors.NotAPolicyError: (a ``TypeError``) if ``policy`` is not a policy instance.
      ValueError: as ``get_loss_scale_state``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> params = {"w": jnp.zeros(2)}
      >>> opt_state = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale()).init(params)
      >>> new_policy = lsj.StaticScale(128.0)
      >>> tx = lsj.loss_scaling(optax.sgd(0.1), new_policy)
      >>> opt_state = lsj.switch_policy(opt_state, new_policy)
      >>> float(lsj.get_loss_scale_state(opt_state).scale)
      128.0
    """
    policy = check_policy(policy)
    return _put(opt_state, policy.conform(get_loss_scale_state(opt_state)))


def _avals(state: LossScaleState) -> list[tuple[str, tuple[int, ...], str]]:
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return [
        (jax.tree_util.keystr(path), tuple(jnp.shape(x)), jnp.dtype(x.dtype).name)
        for path, x in leaves
    ]


def set_loss_scale_state(opt_state: Any, loss_scale_state: LossScaleState) -> Any:
    """``opt_state`` with its one ``LossScaleState`` replaced by ``loss_scale_state``.

    The way to resume a run brought over from another framework: build the
    optimizer with the imported policy, ``init`` it, then put the imported
    state in (the inner optimizer's state is restored as usual, or starts
    fresh). ``switch_policy`` is this call with ``policy.conform`` of the
    current state.

    Rule::

      find the one LossScaleState in opt_state (as get_loss_scale_state does,
        refusing the same nestings)
      check loss_scale_state has its fields, shapes and dtypes
      return opt_state with it replaced (the rest unchanged)

    Args:
      opt_state: an optimizer state holding exactly one ``LossScaleState``
        (as ``get_loss_scale_state`` reads it), or a ``LossScaleState`` itself.
      loss_scale_state: the state to put in, e.g. from
        ``compat.torch.import_state(...)``.

    Returns:
      The optimizer state, same structure, with the new loss-scale state.

    Raises:
      ValueError: as ``get_loss_scale_state``, or if ``loss_scale_state`` does
        not have the same fields, shapes and dtypes.
      TypeError: if ``loss_scale_state`` is not a ``LossScaleState``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> from lossscale_jax import compat
      >>> policy, state = compat.torch.import_state({
      ...     "scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
      ...     "growth_interval": 2000, "_growth_tracker": 7})
      >>> tx = lsj.loss_scaling(optax.sgd(0.1), policy)
      >>> opt_state = lsj.set_loss_scale_state(tx.init({"w": jnp.zeros(2)}), state)
      >>> float(lsj.metrics(opt_state)["loss_scale"]), int(opt_state.loss_scale.growth_count)
      (1024.0, 7)
    """
    if not isinstance(loss_scale_state, LossScaleState):
        raise TypeError(
            f"loss_scale_state must be a LossScaleState, got {type(loss_scale_state).__name__}."
        )
    current = get_loss_scale_state(opt_state)
    if _avals(current) != _avals(loss_scale_state):
        raise ValueError(
            "loss_scale_state does not match the optimizer state's LossScaleState (fields, "
            f"shapes, dtypes): {_avals(loss_scale_state)} vs {_avals(current)}. Build it with "
            "the policy's init() (the compat import functions do)."
        )
    return _put(opt_state, loss_scale_state)


def _put(opt_state: Any, loss_scale_state: LossScaleState) -> Any:
    """``opt_state`` with its one ``LossScaleState`` replaced, unchecked."""
    if isinstance(opt_state, LossScaleState):
        return loss_scale_state
    return jax.tree_util.tree_map(
        lambda x: loss_scale_state if is_loss_scale_state(x) else x,
        opt_state,
        is_leaf=is_loss_scale_state,
    )


def scale_loss(loss: ArrayLike, state: Any) -> jax.Array:
    """Multiplies ``loss`` by the current loss scale.

    Rule::

      scaled = loss * scale          # in float32 at least

    Inside ``lsj.taps.value_and_grad`` (or ``lsj.taps.recording``) the loss is
    tapped first, as ``"loss"``: its cotangent is the scale itself, in the loss's
    dtype, so a float16 loss shows the ceiling (2**16 overflows it) that no
    parameter gradient shows. Elsewhere nothing is added to the program, and the
    update of the same step, given the same state, still learns the loss's dtype
    (a policy that measures the range, ``HeadroomScale``, keeps room for that
    ceiling without taps).

    Args:
      loss: a floating scalar (the loss to differentiate).
      state: an optimizer state holding a ``LossScaleState`` (see
        ``get_loss_scale_state``) or the ``LossScaleState`` itself.

    Returns:
      The scaled loss, in the dtype of ``loss`` promoted to at least float32.

    Raises:
      TypeError: if ``loss`` is not floating; ValueError if it is not a scalar.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> params = {"w": jnp.ones(3)}
      >>> tx = lsj.loss_scaling(optax.sgd(0.1), lsj.DynamicScale(init_scale=2.0**10))
      >>> state = tx.init(params)
      >>> loss16 = jnp.asarray(0.5, jnp.float16)
      >>> scaled = lsj.scale_loss(loss16, state)
      >>> float(scaled), scaled.dtype                   # promoted to float32
      (512.0, dtype('float32'))
      >>> grads = jax.grad(lambda p: lsj.scale_loss(jnp.sum(p["w"]) / 4, state))(params)
      >>> grads["w"].tolist()                           # scaled: tx.update divides them back
      [256.0, 256.0, 256.0]
    """
    # The state's array (an NNX optimizer's state holds Variables; the value is the array).
    scale = jnp.asarray(get_loss_scale_state(state).scale)
    loss = jnp.asarray(loss)
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(f"loss must be a floating scalar, got dtype {loss.dtype}.")
    if loss.shape != ():
        raise ValueError(
            f"loss must be a scalar, got shape {loss.shape}; reduce it (e.g. mean) first."
        )
    dtype = at_least_float32(loss.dtype)
    _loss_note.note(scale, loss.dtype)  # the update of this step reads it (HeadroomScale)
    tapped = jnp.asarray(tap_array(loss, "loss"))  # the identity unless taps are recorded
    scaled = tapped.astype(dtype) * scale.astype(dtype)
    _wiring.scaled(loss, scale)  # the update of this step checks its wiring
    return scaled
