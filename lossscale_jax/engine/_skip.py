"""How the engine's one decision becomes code: a conditional, or a select per leaf.

Two formulations of ``good(*operands) if apply else skip(*operands)``:

- ``"cond"``: one ``lax.cond``; the good branch runs only on a good step. XLA:CPU takes it
  (measured there: a ``jnp.where`` over every optimizer leaf cost a plain Adam step 1.7x-5x
  and much compile time; the conditional 1.1x-1.3x), and TPU keeps it (not measured).
- ``"select"``: both branches computed, each output leaf chosen with ``jnp.where``. XLA:GPU
  (CUDA and ROCm) takes it: there a conditional is resolved by the host. XLA:GPU's
  conditional copies its predicate to the host and blocks the host until the stream has
  computed it, in the middle of every step, so the host cannot queue the next step ahead; and
  with the step's buffers donated, XLA:GPU (jaxlib 0.10.2) copies every parameter and moment
  out of the conditional, a second pass over the optimizer's memory. A select is fused into
  the kernels that compute each leaf: no host round trip, no copy, the bytes of the peers'
  whole-tree ``jnp.where`` (docs/performance.md has the compiled H100 step's numbers).

Which one a step gets is decided by the platform it is *lowered* for (:data:`BY_PLATFORM`),
not by the platforms the process has: a step is often compiled where it does not run
(``jax.export`` with ``platforms=("cuda",)``, ahead-of-time compilation on a CPU host, the
benchmark's ``--compile-for``). So a step traced with no override holds both formulations and
``jax.lax.platform_dependent`` keeps, at lowering, the one of the platform lowered for; JAX
lowers that branch alone (lowered for one platform, the program holds the kept branch inside
``platform_dependent``'s switch on a constant, which XLA folds before anything else: XLA:CPU's
optimized program is the conditional's, as in a step that traced it alone). What it costs: the
good branch is traced once (:func:`traced_once`: its shapes, its effects and both formulations'
branches inline one jaxpr), the skip branch (constants and the operands as they were) once per
use; the jaxpr holds the good branch once per formulation, which JAX lowers for the kept one
alone: nothing at run time and nothing in what XLA compiles. Worth it: the program compiled
for a GPU off one is the GPU's, which a formulation chosen from the process's platforms got
wrong (the CPU's conditional, or the select fenced for the CPU, lowered for a GPU). A cheaper
way would decide in a primitive lowered per platform (as :func:`fenced`'s fence and the check's
formulation are, ``_platform``), but the choice here is control flow: such a primitive would
carry the branches as jaxprs and need its own rules for every transformation ``lax.cond`` has.

Both select the same operands on every step (the skip branch's outputs are constants or the
operands as they were; the good branch's are selected whole), and the property test runs
the engine's front-ends under each (``tests/test_engine_properties.py``). Their values are
the same bits where the good branch is computed alike: a conditional's branch is cut off
from the backward pass before it and the parameter update after it, a select's would be fused
with both, and XLA:CPU then contracts another multiply with the add after it into a fused
multiply-add (one rounding fewer, an ulp apart from the first step). So where a select is
lowered for the CPU its good branch is fenced as the conditional's is (:func:`fenced`: an
``optimization_barrier`` lowered for the CPU alone, ``_platform``): with jaxlib 0.12 the two give
the same bits step for step (Adam, AdamW, SGD with momentum; the Optax path, the fused step,
windows; ``tests/test_formulations.py``), and a run resumes under the other bit for bit. Where
XLA:CPU expands the fences before fusion (jaxlib 0.10) each step is within an ulp (two over a
window) of the other's from the same state, and per-layer scaling without accumulation keeps
that difference even with them. Lowered for a GPU the select has no fence, whatever process
lowers it: fused into the optimizer's kernels is its reason to be taken (not measured against
its conditional). Two overrides, read while a step is traced: the environment variable
``LOSSSCALE_JAX_SKIP`` (:data:`ENV`: ``cond`` or ``select`` on every backend, the other
formulation not traced; CI runs the stepping tests under ``select`` on CPU, so the GPU's
formulation runs on every change) and, inside the library's tests and benchmark,
:func:`formulation`, which takes precedence. The fence stays the CPU's under either.

Effects stay with the steps that apply. A select computes the good branch on every step, so
anything with an effect in it (a ``checkify`` check, a ``jax.debug.print`` or callback, an
inner transformation's own effects) would happen on skipped steps too. A decision whose
branches have effects (``jax.make_jaxpr(branch).effects``) is therefore taken with
``lax.cond`` on every backend (:func:`choose`): the effect happens exactly when the branch's
result is used, at the price of the conditional on a GPU. The library's own check
(``on_stuck="error"``) is outside the branches, gated by the decision (``stuck.check_stuck``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from lossscale_jax.engine import _devices
from lossscale_jax.engine._devices import match_varying
from lossscale_jax.engine._ops import where
from lossscale_jax.engine._platform import fence_on_cpu, row_major_on_cpu

FORMULATIONS = ("cond", "select")

ENV = "LOSSSCALE_JAX_SKIP"
"""The environment variable that forces one formulation on every backend (``cond`` or
``select``; unset or empty: each platform's own). Read when a step is traced: set it before
the process traces its steps (a step traced once keeps what it was traced with)."""

BY_PLATFORM: dict[str, str] = {"cpu": "cond", "cuda": "select", "rocm": "select", "tpu": "cond"}
"""The formulation each platform gets (the module's docstring says why); a platform not
listed gets ``"cond"``. benchmarks/README.md says how to measure one against the other."""

# The override is a JAX user context: JAX's trace caches (jit, eval_shape, an inner jit) key on
# a function and its arguments and on the user contexts' values, so a step traced under one
# formulation is never reused under another, and the value is read from it while tracing.
_OVERRIDE = jax.make_user_context(None)


@contextlib.contextmanager
def formulation(name: str) -> Iterator[None]:
    """Steps traced inside use ``name`` (``"cond"`` or ``"select"``) on every backend."""
    if name not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {name!r}.")
    with _OVERRIDE(name):
        yield


def current() -> str | None:
    """The overriding formulation, or ``None`` (each platform's own): :func:`formulation`'s,
    else :data:`ENV`'s.

    Raises:
      ValueError: if :data:`ENV` holds anything but ``cond``, ``select`` or nothing.
    """
    forced = _OVERRIDE.value
    if forced is not None:
        return forced
    value = os.environ.get(ENV, "")
    if value == "":
        return None
    if value not in FORMULATIONS:
        raise ValueError(
            f"the environment variable {ENV} must be one of {FORMULATIONS} (or unset, for "
            f"each platform's own formulation), got {value!r}."
        )
    return value


def here() -> set[str]:
    """The formulations a step traced with no override holds: every platform's of
    :data:`BY_PLATFORM` (and ``"cond"``, for a platform not listed), in every process.

    A step is traced before the platform it is lowered for is known (one traced step may be
    lowered for a platform this process lacks: ``lowering_platforms``, ``jax.export``), so
    several are traced once each and ``platform_dependent`` keeps the one of the platform the
    step is lowered for; one (a table whose platforms all take the same) is traced alone.
    """
    return {"cond", *BY_PLATFORM.values()}


def fenced(true_fun: Callable) -> Callable:
    """``true_fun`` with its operands and its outputs behind :func:`_platform.fence_on_cpu`:
    lowered for the CPU, between two ``optimization_barrier``s; lowered elsewhere, as it is.

    What the conditional's boundary does for the good branch: XLA fuses nothing across it, so
    the branch's kernels are cut where ``lax.cond`` cuts them. Without it XLA:CPU fuses the
    producers of the operands (the backward pass's transposed gradient) into the optimizer's
    kernels and the parameter update into its consumer (``p + where(apply, u, -0.0)``), and
    LLVM contracts a different multiply into a fused multiply-add there: one rounding fewer,
    ulps apart from the conditional's values from the first step. XLA expands the barriers
    after fusion (jaxlib 0.12; jaxlib 0.10.2's XLA:CPU expands them before fusion, where they
    change nothing). A GPU gets no barrier: it would cut the select out of the optimizer's
    kernels, the reason a GPU takes the select (compiled for an H100, lm_185m's optimizer
    step fenced ran 324 kernels and moved 2.31x plain's bytes, against 99 and 1.077x).
    """

    def branch(*operands: Any) -> Any:
        return fence_on_cpu(true_fun(*fence_on_cpu(operands)))

    return branch


def cond(pred: jax.Array, true_fun: Callable, false_fun: Callable, *operands: Any) -> Any:
    """The conditional (``"cond"``): ``_devices.cond``, its operands laid out row-major where
    the step is lowered for the CPU (:func:`_platform.row_major_on_cpu`: a gradient the
    backward pass writes transposed is written row-major by its own kernel, not copied into
    that order in the branch: 3 kernels fewer, and one pass over those gradients, on the
    34M MLP of ``bench_first_call.py``)."""
    return _devices.cond(pred, true_fun, false_fun, *row_major_on_cpu(operands))


def select_outputs(pred: jax.Array, true_fun: Callable, false_fun: Callable, *operands: Any) -> Any:
    """Both branches, each output leaf picked by ``pred`` (``"select"``). The good branch is
    :func:`fenced`: lowered for the CPU it rounds as the conditional's branch does; lowered for
    a GPU the select stays fused into the optimizer's kernels (its reason to take it)."""
    good = fenced(true_fun)(*operands)
    skip = false_fun(*operands)
    # Selected on the skip (not(apply): the policy's last_skipped, the negation folded away), so
    # that no kernel of its own negates the decision for the leaves' selects (XLA:GPU).
    skipped = jnp.logical_not(pred)
    return jax.tree_util.tree_map(lambda g, s: where(skipped, s, g), good, skip)


def has_effects(fun: Callable[..., Any], *operands: Any) -> bool:
    """Whether tracing ``fun(*operands)`` records an effect (a ``checkify`` check, a debug
    print or callback, an ``io_callback``, ...), which a select would run on every step."""
    traced = getattr(fun, _TRACE, None)
    if traced is not None:
        return traced(*operands)[1]
    return bool(jax.make_jaxpr(fun)(*operands).effects)


def shapes_of(fun: Callable[..., Any], *operands: Any) -> Any:
    """``jax.eval_shape(fun, *operands)``; from the trace :func:`traced_once` keeps, where
    ``fun`` is one of its functions."""
    traced = getattr(fun, _TRACE, None)
    if traced is not None:
        return traced(*operands)[0]
    return jax.eval_shape(fun, *operands)


def traced_once(fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun``, its trace made once and reused by every use in the step being traced.

    A decision's good branch is used four times while a step is traced: its shapes
    (:func:`shapes_of`), its effects (:func:`has_effects`), the conditional's branch and the
    select's. Each would trace ``fun`` (the inner optimizer's update, in Python) again; wrapped
    in ``jax.jit(..., inline=True)`` it is traced once, JAX's trace cache keeps the jaxpr (keyed
    on ``fun`` and its operands' types, and ``fun`` is made anew for each step traced), and each
    use inlines it: the jaxpr of every use, and so the program, is the one tracing ``fun`` there
    gives. The shapes and the effects come from one ``jitted.trace`` of the same operands, kept
    for them (each call of the jit handles every operand anew: some 2,800 Python calls for the
    GPT's 157). Idempotent: a function it returned comes back as it is.
    """
    if getattr(fun, _TRACE, None) is not None:
        return fun
    jitted = jax.jit(fun, inline=True)
    last: dict[Any, tuple[Any, bool]] = {}  # the operands' types: (the shapes, has effects)

    def once(*operands: Any) -> Any:
        return jitted(*operands)

    def trace(*operands: Any) -> tuple[Any, bool]:
        # The shapes and the effects are asked of the same operands, one after the other:
        # one ``jitted.trace`` answers both (and fills the jit's cache for the branches). Kept
        # by the operands' types, as the jit's cache keys its trace, and holding no tracer.
        leaves, tree = jax.tree_util.tree_flatten(operands)
        key = (tree, tuple(jax.typeof(x) if isinstance(x, jax.Array) else x for x in leaves))
        try:
            found = last.get(key)
        except TypeError:  # an operand that is not hashable: traced each time
            found, key = None, None
        if found is None:
            traced = jitted.trace(*operands)
            found = (traced.out_info, bool(traced.jaxpr.effects))
            if key is not None:
                last.clear()
                last[key] = found
        return found

    setattr(once, _TRACE, trace)
    return once


_TRACE = "_lossscale_jax_traced_once"  # a traced_once function's trace of given operands


def choose(
    pred: jax.Array, true_fun: Callable[..., Any], false_fun: Callable[..., Any], *operands: Any
) -> Any:
    """``true_fun(*operands) if pred else false_fun(*operands)``, in the formulation the
    override or the platform gives (``"cond"``: ``_devices.cond``, ``lax.cond`` with its
    branches matched under ``shard_map``); ``"cond"`` wherever a branch has effects (the
    module's docstring says why)."""
    impls = {"cond": cond, "select": select_outputs}
    true_fun = traced_once(true_fun)
    forced = current()
    wanted = {forced} if forced is not None else here()
    if "select" in wanted and (
        has_effects(true_fun, *operands) or has_effects(false_fun, *operands)
    ):
        wanted = {"cond"}
    if len(wanted) == 1:
        return impls[wanted.pop()](pred, true_fun, false_fun, *operands)
    # One branch per formulation: the platforms that take "cond" (and any platform not in
    # the table) share the default branch, the others one branch each formulation, so
    # platform_dependent traces each formulation once.
    formulations = [
        (lambda *a, f=impls[name]: f(pred, true_fun, false_fun, *a)) for name in FORMULATIONS
    ]
    # Under shard_map the platforms' branches must agree in what varies over its axes too.
    matched = match_varying(formulations, *operands)
    branches: dict[str, Callable[..., Any]] = dict(zip(FORMULATIONS, matched, strict=True))
    per_platform = {
        platform: branches[name] for platform, name in BY_PLATFORM.items() if name != "cond"
    }
    return jax.lax.platform_dependent(*operands, default=branches["cond"], **per_platform)


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
        want = shapes_of(good, *operands)
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
