"""``TapStats``: what the taps saw in one backward pass, one float32 vector per tap.

A tap's vector is the "gradient" of a zero-valued input (its sink), so JAX adds the vectors of
every use of one sink: a tap inside ``lax.scan`` (its sink closed over, used once per
iteration), a layer called twice, a sink replicated across ``shard_map`` devices. The layout is
chosen so that a sum still answers every question the statistics are for:

  ========  ==============================================================================
  index     per use (the sum over uses is what is stored)
  ========  ==============================================================================
  USES      1
  MAX       max |cotangent| over its finite entries
  NONFINITE entries of the cotangent that are inf or nan (or past its dtype's range: kept
            wider by the compiler, they are the infs the dtype would hold)
  NONZERO   finite nonzero entries
  UNDERFLOW finite nonzero entries below float16's smallest normal, 2**-14 (zero or
            subnormal in float16: for a float16 cotangent, the subnormal ones)
  SIZE      entries
  FWD_MAX   max |activation| over its finite entries (forward statistics, when recorded)
  FWD_NONFINITE  activation entries that are inf or nan (idem)
  FWD_SIZE  activation entries when the forward statistics are recorded, else 0
  BUCKETS   one-hot of the binary exponent of MAX (``frexp``), ``N_BUCKETS`` wide
  ========  ==============================================================================

A max does not survive a sum, so ``max_abs`` reads MAX only for a tap used once; for more
uses it is ``min(sum of the maxima, 2 ** e)`` with ``e`` the highest exponent seen in the
buckets: an upper bound of the true maximum within a factor of 2, always at or above it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale_jax.engine._ops import where

USES, MAX, NONFINITE, NONZERO, UNDERFLOW, SIZE, FWD_MAX, FWD_NONFINITE, FWD_SIZE = range(9)
HEAD = 9
# frexp exponents of finite nonzero float32 magnitudes: -148 (2**-149) to 128 (below 2**128).
EXP_MIN = -148
N_BUCKETS = 128 - EXP_MIN + 1
WIDTH = HEAD + N_BUCKETS
# float16's smallest normal: a magnitude below it is subnormal (or zero) in float16.
F16_TINY = float(np.finfo(np.float16).tiny)
F32 = jnp.float32


def rounds_to_inf(dtype: Any) -> float:
    """The smallest magnitude that rounds to inf in ``dtype`` (its largest finite value plus
    half its last spacing: round to nearest, the tie to the even infinity), as a float32
    (``inf`` for float32 and wider)."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize >= 4:
        return float("inf")
    info = jnp.finfo(dtype)  # the last spacing below the largest value: 2**(maxexp-1-nmant)
    return float(np.float32(float(info.max) + 2.0 ** (info.maxexp - 2 - info.nmant)))


def _abs32(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``|x|`` in float32 with its non-finite entries 0, and which entries are finite in
    ``x``'s dtype. A compiler may keep a float16 value in float32 (XLA's excess precision:
    XLA:GPU drops a convert to float16 and back inside a fusion), so an entry past what the
    dtype holds counts as the inf that float16 would have made of it."""
    a = jnp.abs(x.astype(F32)) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.abs(x).astype(F32)
    finite = jnp.isfinite(a)
    limit = rounds_to_inf(x.dtype)
    if limit != float("inf"):
        finite = jnp.logical_and(finite, a < F32(limit))
    return where(finite, a, F32(0.0)), finite


def measure_backward(ct: jax.Array) -> jax.Array:
    """The backward half of one use's vector (forward fields 0): one read of ``ct``."""
    a, finite = _abs32(ct)
    peak = jnp.max(a, initial=F32(0.0))
    nonzero = a > 0
    head = jnp.stack(
        [
            F32(1.0),
            peak,
            jnp.sum(jnp.logical_not(finite), dtype=F32),
            jnp.sum(nonzero, dtype=F32),
            jnp.sum(jnp.logical_and(nonzero, a < F16_TINY), dtype=F32),
            F32(ct.size),
            F32(0.0),
            F32(0.0),
            F32(0.0),
        ]
    )
    exponent = jnp.frexp(peak)[1].astype(jnp.int32)
    bucket = jax.nn.one_hot(exponent - EXP_MIN, N_BUCKETS, dtype=F32) * (peak > 0).astype(F32)
    return jnp.concatenate([head, bucket])


def measure_forward(x: jax.Array) -> jax.Array:
    """The forward fields of one use's vector (every other field 0)."""
    a, finite = _abs32(x)
    values = jnp.stack(
        [
            jnp.max(a, initial=F32(0.0)),
            jnp.sum(jnp.logical_not(finite), dtype=F32),
            F32(x.size),
        ]
    )
    return jnp.zeros([WIDTH], F32).at[FWD_MAX : FWD_SIZE + 1].set(values)


def _limit(dtype: str) -> float:
    return float(jnp.finfo(jnp.dtype(dtype)).max)


@jax.tree_util.register_pytree_node_class
class TapStats:
    """What every tap saw in one backward pass, in the order the forward pass met them.

    A pytree: its leaves are one ``float32[WIDTH]`` vector per tap (a leading device
    axis under ``pmap``), its static part the tap names and the dtypes of the tapped
    values. It is what ``lsj.taps.value_and_grad`` returns beside the gradients, and
    what ``tx.update(..., taps=stats)`` reads. Build the zero-valued sinks with
    ``lsj.taps.discover``; read the statistics with the methods below (arrays, no
    host sync).

    Attributes:
      names: the tap names, in forward order (a module path, ``"loss"``, or the
        name given to ``lsj.tap``; a name met again in one pass gets ``#2``, ``#3``).
      dtypes: the dtype of each tapped value (its cotangent has the same dtype).
      values: one float32 vector per tap (its layout: the statistics the methods below read).
      scaled: the taps that multiplied the backward signal by a per-layer factor
        (``lsj.layerwise.value_and_grad``); empty otherwise.
    """

    def __init__(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        values: Sequence[Any],
        scaled: Sequence[str] = (),
    ) -> None:
        self.names: tuple[str, ...] = tuple(names)
        self.dtypes: tuple[str, ...] = tuple(dtypes)
        self.values: tuple[Any, ...] = tuple(values)
        self.scaled: tuple[str, ...] = tuple(scaled)
        if not len(self.names) == len(self.dtypes) == len(self.values):
            raise ValueError(
                f"TapStats needs one dtype and one vector per name, got {len(self.names)} "
                f"names, {len(self.dtypes)} dtypes and {len(self.values)} vectors."
            )

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[tuple[str, ...], ...]]:
        """The vectors (the pytree's leaves), and the names, dtypes and scaled taps."""
        return self.values, (self.names, self.dtypes, self.scaled)

    @classmethod
    def tree_unflatten(cls, aux: Any, values: Any) -> TapStats:
        """The inverse of ``tree_flatten``."""
        return cls(aux[0], aux[1], values, aux[2])

    @classmethod
    def zeros(cls, names: Sequence[str], dtypes: Sequence[str]) -> TapStats:
        """The sinks: one zero vector per tap."""
        return cls(names, dtypes, [jnp.zeros([WIDTH], F32) for _ in names])

    def __repr__(self) -> str:
        return f"TapStats({len(self.names)} taps: {', '.join(self.names)})"

    def __len__(self) -> int:
        return len(self.names)

    def fold(self, axis: int = 0) -> TapStats:
        """The statistics of a batch of passes as one pass's, folded over ``axis``.

        ``jax.vmap`` of a tapped function (per-example gradients) returns one vector per
        example: a leading batch axis. Folded, the counts add up (uses, inf/nan, nonzero,
        below 2**-14, entries) and ``max_abs`` is the largest of the examples' (exact where
        each example's is). The result is what ``tx.update(..., taps=)`` takes::

          loss, grads, taps = jax.vmap(lsj.taps.value_and_grad(f), (None, 0))(params, xs)
          updates, opt_state = tx.update(grads_of_the_batch, opt_state, params,
                                         taps=taps.fold())

        Under ``pmap`` or ``shard_map`` each device passes its own statistics inside the
        mapped step instead (the engine reduces over the axis).
        """
        folded = []
        for v in self.values:
            v = jnp.asarray(v, F32)
            if v.ndim < 2 or v.shape[-1] != WIDTH:
                raise ValueError(
                    f"fold needs a batch of statistics (shape (batch, ..., {WIDTH})), got a "
                    f"vector of shape {v.shape}."
                )
            total = jnp.sum(v, axis=axis)
            peaks = jnp.max(v[..., [MAX, FWD_MAX]], axis=axis)
            # A max over examples, stored where a sum over uses would be: max_abs reads
            # min(MAX, the highest bucket's power of 2), which is this max (it is below it).
            folded.append(total.at[..., MAX].set(peaks[..., 0]).at[..., FWD_MAX].set(peaks[..., 1]))
        return TapStats(self.names, self.dtypes, folded, self.scaled)

    def _field(self, index: int) -> dict[str, jax.Array]:
        return {n: v[..., index] for n, v in zip(self.names, self.values, strict=True)}

    def uses(self) -> dict[str, jax.Array]:
        """Per tap, how many times its cotangent was measured (per device)."""
        return self._field(USES)

    def max_abs(self) -> dict[str, jax.Array]:
        """Per tap, the largest magnitude of the cotangent's finite entries: exact for a
        tap used once, an upper bound within a factor of 2 otherwise (see the module
        docstring)."""
        out = {}
        for n, v in zip(self.names, self.values, strict=True):
            seen = v[..., HEAD:] > 0
            top = N_BUCKETS - 1 - jnp.argmax(seen[..., ::-1], axis=-1)
            bound = where(jnp.any(seen, axis=-1), jnp.ldexp(F32(1.0), top + EXP_MIN), F32(0.0))
            out[n] = where(v[..., USES] <= 1, v[..., MAX], jnp.minimum(v[..., MAX], bound))
        return out

    def nonfinite(self) -> dict[str, jax.Array]:
        """Per tap, the cotangent's inf and nan entries (a float32 count)."""
        return self._field(NONFINITE)

    def underflow_fraction(self) -> dict[str, jax.Array]:
        """Per tap, the fraction of finite nonzero cotangent entries below 2**-14 (zero or
        subnormal in float16); 0 where there is no nonzero entry."""
        return {
            n: v[..., UNDERFLOW] / jnp.maximum(v[..., NONZERO], F32(1.0))
            for n, v in zip(self.names, self.values, strict=True)
        }

    def forward_max_abs(self) -> dict[str, jax.Array]:
        """Per tap, the largest magnitude of the activation's finite entries (0 unless the forward
        statistics were recorded; a sum over uses, like ``max_abs``'s MAX)."""
        return self._field(FWD_MAX)

    def forward_nonfinite(self) -> dict[str, jax.Array]:
        """Per tap, the activation's inf and nan entries (when recorded)."""
        return self._field(FWD_NONFINITE)

    def overflow(self, mode: str = "ieee") -> jax.Array:
        """Whether a tap's cotangent left its dtype's range: a bool array (per device).

        ``"ieee"``: an inf or nan entry; ``"saturating"``: also a finite entry at
        the dtype's largest value (what a saturating device writes); ``"both"``: the
        same as ``"saturating"``.
        """
        if not self.values:
            return jnp.zeros([], jnp.bool_)
        found = jnp.zeros(jnp.shape(self.values[0])[:-1], jnp.bool_)
        peaks = self.max_abs()
        for n, d, v in zip(self.names, self.dtypes, self.values, strict=True):
            found = jnp.logical_or(found, v[..., NONFINITE] > 0)
            if mode != "ieee":
                found = jnp.logical_or(found, peaks[n] >= F32(_limit(d)))
        return found

    def range_fraction(self, scale: jax.Array) -> jax.Array:
        """``max over taps of max_abs / (scale * finfo(dtype).max)``, float32: the
        fraction of each tapped dtype's range the cotangents would fill at scale 1
        (the quantity ``HeadroomScale`` keeps room for). 0 with no tap."""
        out = jnp.zeros(jnp.shape(scale), F32)
        for u in self.range_fractions({n: scale for n in self.names}).values():
            out = jnp.maximum(out, u)
        return out

    def range_fractions(self, scales: Mapping[str, Any]) -> dict[str, jax.Array]:
        """Per tap, ``max_abs / (scales[name] * finfo(dtype).max)`` in float32: the
        fraction of its dtype's range its cotangent would fill at scale 1, each tap
        measured at a scale of its own (per-layer scaling)."""
        peaks = self.max_abs()
        return {
            n: peaks[n] / (jnp.asarray(scales[n], F32) * F32(_limit(d)))
            for n, d in zip(self.names, self.dtypes, strict=True)
        }

    def summary(self) -> dict[str, dict[str, jax.Array]]:
        """Per tap: ``max_abs``, ``nonfinite``, ``underflow_fraction``, ``uses``
        (arrays: log them with ``jax.device_get``)."""
        peaks, bad, under, uses = (
            self.max_abs(),
            self.nonfinite(),
            self.underflow_fraction(),
            self.uses(),
        )
        return {
            n: {
                "max_abs": peaks[n],
                "nonfinite": bad[n],
                "underflow_fraction": under[n],
                "uses": uses[n],
            }
            for n in self.names
        }
