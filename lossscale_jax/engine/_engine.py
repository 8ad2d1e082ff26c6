"""The engine: the one place that checks, reduces over devices, adjusts and selects the branch.

Every front-end (``loss_scaling``, ``apply_gradients``, ``loss_scaling_multi_steps``,
``compat.torch.multi_optimizer``, and through them the Flax train states and the compat
wrappers) builds an ``Engine`` from its arguments and runs a step as::

  check = engine.check(scaled_grads, loss_scale.scale, record)   # one read, one collective
  check = engine.fold(window, check)                              # accumulation only
  loss_scale, apply = engine.decide(loss_scale, check)            # policy.adjust, on_stuck
  out = engine.select(apply, good, skip, operands)                # the one decision (_skip)

A front-end adds only what is its own: where the update lands (the Optax updates, the
parameters), what counts as a step (a call, a window). tests/reference_engine.py is the
NumPy model of this rule that every front-end is checked against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lossscale_jax.engine import _check, _check_rows, _devices, _loss_note, _skip, _stuck, _wiring
from lossscale_jax.engine._platform import one_kernel_on_cpu
from lossscale_jax.engine._policy import LossScalePolicy, check_policy
from lossscale_jax.engine._state import LossScaleState, unlanded_step
from lossscale_jax.engine._tap_stats import WIDTH, TapStats
from lossscale_jax.engine._unscale import scale_is_bad, unscale_tree
from lossscale_jax.errors import StructureError, TapError

ATTRIBUTIONS: tuple[str | None, ...] = ("reduced", "local", None)

_S = TypeVar("_S")


def validate_attribution(attribution: Any) -> str | None:
    """Returns ``attribution`` if it names a per-leaf record, else raises ``ValueError``."""
    if attribution is not None and (
        not isinstance(attribution, str) or attribution not in ATTRIBUTIONS
    ):
        raise ValueError(f"attribution must be one of {ATTRIBUTIONS}, got {attribution!r}.")
    return attribution


class Check(NamedTuple):
    """What one step's overflow check saw, reduced over the devices of ``axis_name``.

    Attributes:
      overflow: bool scalar: a gradient overflowed on some device, or the scale is bad.
      flags: ``bool[n]``, one per gradient leaf (ORed over the devices with ``"reduced"``
        attribution); ``None`` when no record is kept.
      amax: float32 scalar, ``max |scaled g| / (scale * finfo(compute_dtype).max)``
        (the largest over the devices); ``None`` unless the policy measures it.
      unlanded, unlanded_flags, float16_leaves: an update would write inf or nan into a
        float16 parameter (``_landing``; ``None``: unchecked), which leaves, their key paths.
    """

    overflow: jax.Array
    flags: jax.Array | None
    amax: jax.Array | None
    segments: jax.Array | None = None  # per-layer scaling: bool[n + 1], a segment overflowed
    unlanded: jax.Array | None = None
    unlanded_flags: jax.Array | None = None
    float16_leaves: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Engine:
    """The validated configuration of one loss-scaling front-end, and its step.

    Built once, when the front-end is built, by ``Engine.build`` (every argument
    checked there, naming it); hashable and static.
    """

    where: str
    policy: LossScalePolicy
    mode: _check.OverflowMode
    compute_dtype: np.dtype
    axis_name: Any
    reduced: tuple[Hashable, ...]
    local: tuple[Hashable, ...]
    on_stuck: str
    attribution: str | None
    wiring_checked: bool = True

    @classmethod
    def build(
        cls,
        where: str,
        policy: Any,
        *,
        overflow: Any = "ieee",
        compute_dtype: Any = jnp.float16,
        axis_name: Any = None,
        local_axes: Any = None,
        on_stuck: Any = "skip",
        attribution: Any = "reduced",
        policy_name: str = "policy",
        check_wiring: Any = True,
    ) -> Engine:
        """An engine from a front-end's arguments; a bad one raises, naming it."""
        reduced, local = _devices.validate_axes(axis_name, local_axes)
        return cls(
            where=where,
            policy=check_policy(policy, policy_name),
            mode=_check.validate_overflow_mode(overflow),
            compute_dtype=_check.validate_compute_dtype(compute_dtype),
            axis_name=axis_name,
            reduced=reduced,
            local=local,
            on_stuck=_stuck.validate_on_stuck(on_stuck),
            attribution=validate_attribution(attribution),
            wiring_checked=_wiring.validate_switch(check_wiring),
        )

    def empty_record(self, params: Any) -> jax.Array | None:
        """The per-leaf record of a fresh state: one ``False`` per leaf of ``params``."""
        if self.attribution is None:
            return None
        return jnp.zeros([len(jax.tree_util.tree_leaves(params))], jnp.bool_)

    def check(
        self,
        grads: Any,
        scale: jax.Array,
        record: jax.Array | None,
        *,
        reduce_flags: bool = False,
        taps: TapStats | None = None,
    ) -> Check:
        """The overflow check of ``grads`` (scaled), reduced over ``axis_name``.

        Rule::

          refuse a mapped axis that is neither reduced nor local (check_mapped_axes)
          flags = one overflow flag per leaf          # one read of each gradient
          found = any(flags) or not (scale finite and > 0)
          amax = max |grads| / (scale * finfo(compute_dtype).max)   # if policy.measures_range
          if taps:                                    # the activation gradients' statistics
              found = found or taps.overflow(mode)   # an inf/nan in a tapped cotangent
              amax = max(amax, taps.range_fraction(scale))   # each against its dtype's max
          if measured and no loss tap and scale_loss saw a float16 loss with this scale:
              found, amax: as the loss's tap would say (its cotangent is the scale itself)
          found, amax, flags = (any, max, any) over axis_name       # one all-reduce
            (flags travel in it with attribution="reduced", or when reduce_flags)

        ``record`` (the state's previous record) only fixes the number of leaves.
        """
        _devices.check_mapped_axes(grads, self.reduced, self.local, self.mode, self.where)
        self.check_wiring(grads, scale)
        measure = self.policy.measures_range
        amax = None
        if measure:
            flags, raw = _check.leaf_vector(grads, self.mode, self.compute_dtype, with_max=True)
            limit = jnp.float32(_check.threshold(self.compute_dtype))
            amax = raw / (scale.astype(jnp.float32) * limit)
        else:  # in rows where the step is lowered for a GPU (_check_rows: fewer kernels there)
            flags = _check_rows.leaf_vector(grads, self.mode, self.compute_dtype)
        found = jnp.logical_or(jnp.any(flags), scale_is_bad(scale))
        if taps is not None:
            found, amax = self._with_taps(taps, scale, found, amax)
        if amax is not None and (taps is None or "loss" not in taps.names):
            # No loss tap: what it would have said, from the dtype scale_loss saw (_loss_note).
            loss_dtype = _loss_note.loss_dtype(scale)
            if loss_dtype is not None and loss_dtype != np.float32:
                loss_tap = _loss_note.loss_tap(scale, loss_dtype)
                found, amax = self._with_taps(loss_tap, scale, found, amax)
        if record is not None and record.shape[-1:] != flags.shape:
            raise StructureError(
                f"the gradients have {flags.shape[0]} leaves but the optimizer state's "
                f"per-leaf overflow record (leaf_overflow) has {record.shape[-1]}: tx.init was "
                "given parameters of another structure. Pass gradients with the structure of "
                "the parameters given to tx.init."
            )
        keep = self.attribution is not None or reduce_flags
        shared = keep and (reduce_flags or self.attribution == "reduced")
        found, amax, reduced = _devices.reduce_packed(
            found, amax, flags if shared else None, self.axis_name
        )
        if shared:
            flags = reduced
        return Check(found, flags if keep else None, amax)

    def check_wiring(self, grads: Any, scale: jax.Array) -> None:
        """Refuses gradients this update must not divide by ``scale`` (``_wiring``)."""
        _wiring.refuse_non_float(grads, self.where)
        _wiring.check_update(grads, scale, self.where, self.policy, self.wiring_checked)

    def _with_taps(
        self, taps: Any, scale: jax.Array, found: jax.Array, amax: jax.Array | None
    ) -> tuple[jax.Array, jax.Array | None]:
        if not isinstance(taps, TapStats):
            raise TapError(
                f"{self.where}: taps must be the TapStats lsj.taps.value_and_grad returns, "
                f"got {type(taps).__name__}."
            )
        if any(jnp.shape(v) != (WIDTH,) for v in taps.values):
            raise TapError(
                f"{self.where}: each tap's statistics must be one pass's ({WIDTH},) vector, "
                f"got shapes {sorted({jnp.shape(v) for v in taps.values})}. A leading axis "
                "is a batch of passes: from jax.vmap over a tapped function (per-example "
                "gradients), pass taps.fold(axis=0); from pmap or shard_map, call the update "
                "inside the mapped step, with each device's own statistics."
            )
        found = jnp.logical_or(found, taps.overflow(self.mode))
        if amax is not None:
            amax = jnp.maximum(amax, taps.range_fraction(scale))
        return found, amax

    def check_layers(
        self,
        grads: Any,
        scales: jax.Array,
        layers: Any,
        taps: Any,
        loss_scale: jax.Array,
    ) -> Check:
        """The overflow check of per-layer scaled ``grads``, per segment, in one all-reduce.

        ``layers`` (a ``LayerMap``) gives each leaf its segment, names the layer taps in
        forward order; ``scales`` is ``float32[n + 1]``, each segment's cumulative scale
        (the last, the loss's); ``loss_scale``, the state's, is the wiring check's. Rule::

          flags, leaf_max = per-leaf overflow flags and max |g|     # one read of each leaf
          amax[s] = max over leaves of s of leaf_max / (scales[s] * finfo(compute_dtype).max)
          for the tap of layer j (measured before its factor, at scales[j + 1]):
              u = max_abs / (scales[j + 1] * finfo(its dtype).max)
              amax[j] = max(amax[j], u); amax[j + 1] = max(amax[j + 1], u)
              overflowed[j + 1] |= tap inf/nan
          the "loss" tap counts for segment n
          overflowed[s] |= any(flags of leaves of s)
          found = any(overflowed) or the loss scale is not finite and > 0
          (found, amax, overflowed, flags) reduced over axis_name: one all-reduce
        """
        _devices.check_mapped_axes(grads, self.reduced, self.local, self.mode, self.where)
        self.check_wiring(grads, loss_scale)
        leaves = jax.tree_util.tree_leaves(grads)
        if len(leaves) != len(layers.segments):
            raise StructureError(
                f"the gradients have {len(leaves)} leaves but the layer map was made for "
                f"{len(layers.segments)}: pass gradients of the parameters given to "
                "lsj.layerwise.discover."
            )
        if not isinstance(taps, TapStats):
            raise TapError(
                f"{self.where}: per-layer scaling needs taps=, the TapStats "
                "lsj.layerwise.value_and_grad returns (its layer taps measure each segment)."
            )
        if taps.scaled != layers.names:
            raise TapError(
                f"{self.where}: the taps were recorded with factors for {list(taps.scaled)}, "
                f"not for the layers {list(layers.names)}: take the gradients with "
                "lsj.layerwise.value_and_grad(fun, layers, opt_state), which scales each "
                "layer's backward signal by its factor."
            )
        n = len(layers.names)
        f32 = jnp.float32
        flags_list, maxes = _check.every_leaf_flags(leaves, self.mode, self.compute_dtype, True)
        limit = f32(_check.threshold(self.compute_dtype))
        amax = [jnp.zeros([], f32) for _ in range(n + 1)]
        over = [jnp.zeros([], jnp.bool_) for _ in range(n + 1)]
        floats = [i for i, g in enumerate(leaves) if _check.is_float(g)]
        for i, m in zip(floats, maxes, strict=True):
            s = layers.segments[i]
            amax[s] = jnp.maximum(amax[s], m.astype(f32) / (scales[s] * limit))
        for i, flag in enumerate(flags_list):
            s = layers.segments[i]
            over[s] = jnp.logical_or(over[s], flag)
        # a layer tap is measured at the scale of the segment after it; any other tap
        # (the loss's) at the loss's
        after = {
            name: layers.names.index(name) + 1 if name in layers.names else n for name in taps.names
        }
        ranges = taps.range_fractions({name: scales[k] for name, k in after.items()})
        bad = taps.nonfinite()
        for name, u in ranges.items():
            j = after[name] - 1
            for s in {j, j + 1} if name in layers.names else {n}:
                amax[s] = jnp.maximum(amax[s], u)
            over[j + 1] = jnp.logical_or(over[j + 1], bad[name] > 0)
        overflowed = jnp.stack(over)
        found = jnp.logical_or(jnp.any(overflowed), scale_is_bad(scales[n]))
        flags = jnp.stack(flags_list) if flags_list else jnp.zeros([0], jnp.bool_)
        keep = self.attribution is not None
        shared = jnp.concatenate(
            [overflowed, flags if self.attribution == "reduced" else flags[:0]]
        )
        found, amax_v, shared = _devices.reduce_packed(
            found, jnp.stack(amax), shared, self.axis_name
        )
        overflowed = cast(jax.Array, shared)[: n + 1]
        if self.attribution == "reduced":
            flags = cast(jax.Array, shared)[n + 1 :]
        return Check(found, flags if keep else None, amax_v, overflowed)

    @staticmethod
    def fold(window: Check, this: Check) -> Check:
        """The window's check after one more micro-batch: flags ORed, ranges maxed.

        ``window`` is what the window saw so far (``False``, no flag, range 0 at its start);
        both are already reduced over the devices, so the fold is the same on every device.
        """
        flags = None
        if this.flags is not None and window.flags is not None:
            flags = jnp.logical_or(window.flags, this.flags)
        amax = this.amax
        if amax is not None and window.amax is not None:
            amax = jnp.maximum(window.amax, amax)
        segments = this.segments
        if segments is not None and window.segments is not None:
            segments = jnp.logical_or(window.segments, segments)
        return Check(jnp.logical_or(window.overflow, this.overflow), flags, amax, segments)

    def decide(
        self, loss_scale: LossScaleState, check: Check, when: jax.Array | None = None
    ) -> tuple[LossScaleState, jax.Array]:
        """``(new loss-scale state, apply)``: the policy's step, and whether to apply.

        ``apply`` is ``not new_state.last_skipped``; an update that cannot land is skipped
        (``unlanded_step``). With ``on_stuck="error"`` a ``checkify`` check fails when the
        step is stuck (and ``when`` is true: a window's end, for a front-end that decides on
        every call and keeps the decision only there). Called outside the skip's branches, so
        that the check is not run on steps that apply nothing (a select computes both).
        """
        if self.policy.measures_range:
            new = self.policy.adjust(loss_scale, check.overflow, check.amax)
        else:
            # No amax for a policy that does not read it: a user's policy written with
            # adjust(state, overflow) keeps working.
            new = self.policy.adjust(loss_scale, check.overflow)
        new, unlanded = unlanded_step(loss_scale, new, check.overflow, check.unlanded)
        new = one_kernel_on_cpu(new)  # XLA:CPU: one kernel for the state's scalars, not one each
        _stuck.check_stuck(new, self.on_stuck, when, unlanded, check.float16_leaves)
        return new, jnp.logical_not(new.last_skipped)

    @staticmethod
    def select(
        apply: jax.Array, good: Callable, skip: Callable, *operands: Any, good_shapes: Any = None
    ) -> Any:
        """``good(*operands)`` if ``apply`` else ``skip(*operands)``: one ``lax.cond``, or a
        select per output leaf where the backend's formulation says so (``_skip``).

        Good branch first: XLA:CPU inserts fewer copies for this order. Under ``shard_map`` the
        branches' outputs are matched in what they vary over. ``good_shapes``:
        ``jax.eval_shape(good, *operands)``, when the caller has it already.
        """
        good = _skip.traced_once(good)  # one trace: its shapes, effects, every formulation's
        skip = _skip.as_good(good, skip, operands, good_shapes)  # in a good step's dtypes
        return _skip.choose(apply, good, skip, *operands)

    @staticmethod
    def unscale(grads: Any, scale: jax.Array, params: Any = None) -> Any:
        """``grads / scale`` in float32 at least, in the parameters' dtypes."""
        return unscale_tree(grads, scale, params)  # which validates the scale itself


class EngineUpdate:
    """The ``update`` function of a transformation built on the engine.

    Called as any Optax ``update``; it also carries the ``engine`` it runs and the
    ``inner`` transformation it wraps, so that the fused step and the Flax train
    states run the same step (``fusable``: ``apply_gradients`` may run it), and a
    loss scaling nested in another is refused.
    """

    def __init__(
        self,
        update: Callable[..., tuple[Any, Any]],
        engine: Engine,
        inner: optax.GradientTransformationExtraArgs,
        *,
        fusable: bool = False,
        fused_step: Callable[..., tuple[Any, Any]] | None = None,
        not_fusable_because: str | None = None,
    ) -> None:
        self._update = update
        self.engine = engine
        self.inner = inner
        self.fusable = fusable
        # Why apply_gradients refuses this front-end, in its own words (None: the generic
        # message, which names loss_scaling).
        self.not_fusable_because = not_fusable_because
        # A front-end whose fused step is its own (apply_gradients calls it): per-layer scaling.
        self.fused_step = fused_step

    def __call__(
        self, updates: Any, state: Any, params: Any = None, **extra_args: Any
    ) -> tuple[Any, Any]:
        return self._update(updates, state, params, **extra_args)


def engine_of(tx: Any) -> EngineUpdate | None:
    """The ``EngineUpdate`` of a transformation built on the engine, else ``None``."""
    update = getattr(tx, "update", None)
    return update if isinstance(update, EngineUpdate) else None


def check_state(state: Any, cls: type[_S], where: str) -> _S:
    """``state`` if it is the ``cls`` state ``where``'s ``init`` makes, else ``TypeError``."""
    if not isinstance(state, cls):
        raise TypeError(
            f"state must be the {cls.__name__} made by this transformation's init ({where}), "
            f"got {type(state).__name__} (an optimizer state without loss scaling?)."
        )
    return state
