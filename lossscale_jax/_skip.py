"""How the engine's one decision becomes code: a conditional, or a select per leaf.

Two formulations of ``good(*operands) if apply else skip(*operands)``:

- ``"cond"``: one ``lax.cond``; the good branch runs only on a good step. On XLA:CPU, the
  cheaper one (measured there: a ``jnp.where`` over every optimizer leaf cost a plain Adam
  step 1.7x-5x and much compile time; the conditional 1.1x-1.3x).
- ``"select"``: both branches computed, each output leaf chosen with ``jnp.where``. XLA:GPU
  fuses such a select into the kernels that compute the leaf (the peers that skip this way
  measured +0 to +8% over a plain step on an H200), where a conditional is a branch the
  host-side runtime may have to resolve.

Both give the same values on every step (the skip branch's outputs are constants or the
operands as they were; the good branch's are selected whole), and the property test runs
the engine's front-ends under each (``tests/test_engine_properties.py``). Which one a backend
gets is :data:`BY_PLATFORM`; :func:`formulation` overrides it while a step is traced (the
tests and the benchmark use it to measure one against the other). Where the table gives
platforms different formulations, ``jax.lax.platform_dependent`` picks at lowering, so one
traced step serves them all.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

FORMULATIONS = ("cond", "select")

BY_PLATFORM: dict[str, str] = {"cpu": "cond", "cuda": "cond", "rocm": "cond", "tpu": "cond"}
"""The formulation each platform gets. Every platform keeps ``"cond"`` until a measurement
on it shows ``"select"`` faster (benchmarks/README.md says how to measure one against the
other); a platform not listed gets ``"cond"``."""

_OVERRIDE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "lossscale_jax_skip_formulation", default=None
)
# JAX's trace caches (jit, eval_shape, an inner jit) key on a function and its arguments, not
# on this override: its value is also set as a user context, which is part of their key, so a
# step traced under one formulation is never reused under another.
_TRACE_KEY = jax.make_user_context(None)


@contextlib.contextmanager
def formulation(name: str) -> Iterator[None]:
    """Steps traced inside use ``name`` (``"cond"`` or ``"select"``) on every backend."""
    if name not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {name!r}.")
    token = _OVERRIDE.set(name)
    try:
        with _TRACE_KEY(name):
            yield
    finally:
        _OVERRIDE.reset(token)


def current() -> str | None:
    """The overriding formulation, or ``None`` (each platform's own)."""
    return _OVERRIDE.get()


def select_outputs(pred: jax.Array, true_fun: Callable, false_fun: Callable, *operands: Any) -> Any:
    """Both branches, each output leaf picked by ``pred`` (``"select"``)."""
    good = true_fun(*operands)
    skip = false_fun(*operands)
    return jax.tree_util.tree_map(lambda g, s: jnp.where(pred, g, s), good, skip)


def choose(
    cond: Callable[..., Any],
    pred: jax.Array,
    true_fun: Callable[..., Any],
    false_fun: Callable[..., Any],
    *operands: Any,
) -> Any:
    """``true_fun(*operands) if pred else false_fun(*operands)``, in the formulation the
    override or the platform gives; ``cond`` is the conditional to use for ``"cond"``."""
    impls = {"cond": cond, "select": select_outputs}
    forced = current()
    if forced is not None:
        return impls[forced](pred, true_fun, false_fun, *operands)
    wanted = set(BY_PLATFORM.values())
    if len(wanted) == 1:
        return impls[wanted.pop()](pred, true_fun, false_fun, *operands)
    per_platform = {
        platform: (lambda *a, f=impls[name]: f(pred, true_fun, false_fun, *a))
        for platform, name in BY_PLATFORM.items()
    }
    return jax.lax.platform_dependent(
        *operands, default=lambda *a: cond(pred, true_fun, false_fun, *a), **per_platform
    )


def as_good(good: Callable, skip: Callable, operands: tuple, want: Any = None) -> Callable:
    """``skip``, its outputs cast to the dtypes of ``good``'s where only the dtype differs.

    An inner transformation may change a state leaf's dtype on its first update, as Optax's
    Adam does for an integer gradient leaf (its moment starts as the leaf's int32 zeros and
    comes back float32). Optax takes that; a conditional needs both branches alike, so a
    skipped step returns the state as it was in the dtype a good step would have given it
    (the same values: int32 zeros are float32 zeros). ``want``: ``jax.eval_shape(good,
    *operands)``, when the caller has it already (each trace of the update is work).
    """
    if want is None:
        want = jax.eval_shape(good, *operands)
    have = jax.eval_shape(skip, *operands)
    if jax.tree_util.tree_structure(want) != jax.tree_util.tree_structure(have):
        return skip  # lax.cond names the difference
    pairs = zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(have), strict=True)
    if all(w.dtype == h.dtype for w, h in pairs):
        return skip

    def cast(x: Any, w: Any) -> Any:
        return x.astype(w.dtype) if x.dtype != w.dtype and x.shape == w.shape else x

    def skip_as_good(*ops: Any) -> Any:
        return jax.tree_util.tree_map(cast, skip(*ops), want)

    return skip_as_good
