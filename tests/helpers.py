"""Code the test files share (tests/ is on sys.path under pytest: ``from helpers import ...``).

Comparing pytrees bit for bit or by value, finiteness, copies for ``pmap``, a loss-scale
policy run over a sequence of overflow flags, and the repository's scripts and the
benchmark's package as modules. The reference models of the peers' scalers are not helpers:
they live in ``reference_scalers.py``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pathlib
import re
import subprocess
import sys
import textwrap
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
"""The repository's root."""

# --------------------------------------------------------------------------
# Comparing pytrees.


def _leaf_bits(x: Any) -> tuple:
    a = np.asarray(x)
    return a.dtype, a.shape, a.tobytes()


def bits(tree: Any) -> Any:
    """Every leaf as ``(dtype, shape, bytes)``: equal means bit-identical, ``-0.0`` and NaN
    payloads included (a single array gives one such tuple)."""
    return jax.tree_util.tree_map(_leaf_bits, tree)


def assert_bits_equal(a: Any, b: Any, what: str = "") -> None:
    """``a`` and ``b`` have one tree structure, and each leaf the same dtype, shape and bytes."""
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, f"{what}: tree structures differ: {ta} vs {tb}"
    for (path, x), y in zip(la, lb, strict=True):
        assert _leaf_bits(x) == _leaf_bits(y), (
            f"{what}: leaf {jax.tree_util.keystr(path)} differs: {x!r} vs {y!r}"
        )


def assert_trees_equal(a: Any, b: Any, what: str = "") -> None:
    """One tree structure, each leaf the same dtype and shape and equal values (NaN equals
    NaN, ``-0.0`` equals ``0.0``; :func:`assert_bits_equal` tells those apart)."""
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, f"{what}: tree structures differ: {ta} vs {tb}"
    for (path, x), y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        where = f"{what}: leaf {jax.tree_util.keystr(path)}"
        assert (x.dtype, x.shape) == (y.dtype, y.shape), (where, x.dtype, x.shape, y.dtype, y.shape)
        np.testing.assert_array_equal(x, y, err_msg=where)


def skip_formulation() -> str:
    """The skip's formulation a step traced now takes on JAX's default backend: the override
    (``LOSSSCALE_JAX_SKIP``, or a test's ``_skip.formulation``), else the backend's own."""
    from lossscale_jax.engine import _skip

    platform = {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())  # or rocm
    return _skip.current() or _skip.BY_PLATFORM.get(platform, "cond")


def programs_round_alike() -> bool:
    """Whether two compiled programs of one optimizer step (the fused step and the Optax path;
    a step and optax's own update) round its update alike, bit for bit: on XLA:CPU with the
    conditional, where the update is computed in the branch as written.

    A select (a GPU's formulation, or ``LOSSSCALE_JAX_SKIP=select``) fuses the update into the
    optimizer's kernels, and XLA may contract a multiply and the add after it into one fused
    multiply-add in one program and not the other: one rounding fewer, which is at most one
    unit in the last place of the larger of the terms (:func:`assert_step_within_ulps`; seen
    one float32 ulp apart, on XLA:GPU and on XLA:CPU under the select).
    """
    return jax.default_backend() == "cpu" and skip_formulation() == "cond"


FLOAT16_PARAMS = pytest.mark.filterwarnings("ignore::lossscale_jax.errors.Float16OptimizerWarning")
"""For a test whose float16 parameters under an inner optimizer that runs in float16 are the
point (the dtypes kept, the records, an upstream optimizer that trains float16 weights): the
transformation's init warns so, as it should (tests/test_master_weights.py checks that)."""


def barriers_survive_fusion() -> bool:
    """Whether this XLA:CPU keeps an ``optimization_barrier`` through fusion (jaxlib 0.12; 0.10
    expands barriers before fusion), so that a product fenced off is not contracted with the
    sum after it into a fused multiply-add: the condition under which the select rounds as the
    conditional does (lossscale_jax/engine/_skip.py's ``fenced``). Where the host has no fused
    multiply-add there is nothing to contract either, and this says ``True`` too."""
    a, b, c = (np.random.default_rng(i).normal(size=256).astype(np.float32) for i in range(3))
    fenced = jax.jit(lambda a, b, c: jax.lax.optimization_barrier(a * b) + c)(a, b, c)
    return bool(np.array_equal(np.asarray(fenced), (a * b).astype(np.float32) + c))


def assert_step_within_ulps(got: Any, want: Any, before: Any, ulps: int, what: str = "") -> None:
    """One step's results ``got`` against ``want``, both from the same state ``before``: float
    leaves within ``ulps`` units in the last place of the larger of the value before and
    after (the size of the step's terms, where a contraction into a fused multiply-add
    rounds), every other leaf equal; nan where the other has nan."""
    la, ta = jax.tree_util.tree_flatten_with_path(got)
    lb, tb = jax.tree_util.tree_flatten(want)
    lc, tc = jax.tree_util.tree_flatten(before)
    assert ta == tb == tc, f"{what}: tree structures differ"
    for (path, x), y, b in zip(la, lb, lc, strict=True):
        x, y, b = np.asarray(x), np.asarray(y), np.asarray(b)
        where = f"{what}: leaf {jax.tree_util.keystr(path)}"
        assert (x.dtype, x.shape) == (y.dtype, y.shape), (where, x.dtype, y.dtype)
        if not np.issubdtype(x.dtype, np.floating):
            np.testing.assert_array_equal(x, y, err_msg=where)
            continue
        np.testing.assert_array_equal(np.isnan(x), np.isnan(y), err_msg=where)
        with np.errstate(invalid="ignore", over="ignore"):
            size = np.maximum(np.abs(y), np.abs(b.astype(y.dtype)))
            bound = ulps * np.spacing(size).astype(np.float64)
            err = np.abs(x.astype(np.float64) - y.astype(np.float64))
        ok = np.isnan(y) | (x == y) | (err <= bound)
        assert np.all(ok), f"{where}: more than {ulps} ulp(s) apart: {x!r} vs {y!r}"


F16_UNIT_ROUNDOFF = 2.0**-11
"""float16 keeps 11 significant bits: one rounding errs by at most 2**-11 of the value."""


def assert_within_roundings(
    got: Any, want: Any, magnitude: Any, roundings: int, what: str = ""
) -> None:
    """``|got - want| <= roundings * 2**-11 * magnitude``, leaf by leaf, element by element.

    For two float16 programs that compute the same value by different compiled code: XLA may
    keep an intermediate in float32 in one program and round it to float16 in the other
    (fusion decides; XLA:CPU with AVX-512 FP16 and XLA:GPU do). A sum of products differs
    then by at most one unit roundoff per rounding on each term's path, times the sum of
    the terms' magnitudes (the first-order bound of Higham, *Accuracy and Stability of
    Numerical Algorithms*, 3.1). ``magnitude`` is that sum (``|x|.T @ |d|`` for ``x.T @ d``),
    computed by the caller in float64 from the operands.
    """
    la, ta = jax.tree_util.tree_flatten_with_path(got)
    lb, tb = jax.tree_util.tree_flatten(want)
    lm, tm = jax.tree_util.tree_flatten(magnitude)
    assert ta == tb == tm, f"{what}: tree structures differ: {ta} vs {tb} vs {tm}"
    for (path, x), y, m in zip(la, lb, lm, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), (what, path, x.dtype, y.dtype)
        where = f"{what}: leaf {jax.tree_util.keystr(path)}"
        finite = np.isfinite(y)  # inf and nan where the other has them, and the same ones
        np.testing.assert_array_equal(np.isfinite(x), finite, err_msg=where)
        np.testing.assert_array_equal(x[~finite], y[~finite], err_msg=where)
        bound = roundings * F16_UNIT_ROUNDOFF * np.abs(np.asarray(m, np.float64))
        bound = np.where(finite, bound, 0.0)
        err = np.abs(np.where(finite, x, 0).astype(np.float64) - np.where(finite, y, 0))
        worst = int(np.argmax(err - bound))
        assert np.all(err <= bound), (
            f"{where} differs by more than {roundings} "
            f"float16 roundings: {x.ravel()[worst]!r} vs {y.ravel()[worst]!r} "
            f"(bound {bound.ravel()[worst]:.3g})"
        )


# What a compiled step would need to stop for the host: a Python callback (jax.debug.print,
# pure_callback, io_callback, a host-side check), an outfeed or a host send/receive.
HOST_OPS = re.compile(r"custom_call_target=\"[^\"]*callback[^\"]*\"|\b(outfeed|infeed|send|recv)\(")


def assert_no_host_round_trip(jitted: Any, *args: Any) -> None:
    """The optimized program of ``jitted(*args)`` contains nothing that waits for the host.

    The backend-independent half of a "no host sync" test: ``jax.transfer_guard("disallow")``
    fails a device-to-host read on a GPU but not on a CPU, whose arrays are already host
    memory; this check reads the compiled program and fails on any backend.
    """
    text = jitted.lower(*args).compile().as_text()
    found = sorted({m.group(0) for m in HOST_OPS.finditer(text)})
    assert not found, f"the compiled step waits for the host: {found}"


def multisteps_state(every_k: int, inner: Any, params: Any) -> Any:
    """The state ``optax.MultiSteps(inner, every_k).init(params)`` would make, built without
    calling it: the library refuses a loss scaling inside MultiSteps at its ``init``, and the
    tests that show why still need the nesting's state."""
    import optax

    plain = optax.MultiSteps(optax.identity(), every_k_schedule=every_k).init(params)
    return plain._replace(inner_opt_state=inner.init(params))


def all_finite(tree: Any) -> bool:
    """Whether every element of every floating-point leaf is finite (other leaves pass)."""
    return all(
        bool(np.all(np.isfinite(np.asarray(x))))
        for x in jax.tree_util.tree_leaves(tree)
        if jnp.issubdtype(np.asarray(x).dtype, jnp.inexact)
    )


# --------------------------------------------------------------------------
# Devices (conftest.py gives the tests 8 CPU devices).


def replicate(tree: Any, n: int) -> Any:
    """Host copies with a leading axis of ``n`` (what ``pmap`` takes as a replicated input)."""
    return jax.tree_util.tree_map(lambda a: np.broadcast_to(np.asarray(a), (n, *np.shape(a))), tree)


def assert_same_on_every_device(tree: Any, n: int) -> None:
    """Every leaf has a leading device axis of ``n`` whose slices are bit-identical."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        a = np.asarray(leaf)
        assert a.shape[0] == n, (jax.tree_util.keystr(path), a.shape)
        for d in range(1, n):
            assert a[d].tobytes() == a[0].tobytes(), (
                f"{jax.tree_util.keystr(path)} differs between device 0 and device {d}: "
                f"{a[0]!r} vs {a[d]!r}"
            )


# --------------------------------------------------------------------------
# A policy over a sequence of overflow flags.


@functools.partial(jax.jit, static_argnums=0)
def _scan_policy(policy, state, flags):
    def body(s, f):
        s = policy.adjust(s, f)
        return s, s

    return jax.lax.scan(body, state, flags)[1]


def run_policy(policy, flags, state=None) -> Any:
    """The states of ``policy.adjust`` over ``flags`` (True = overflow), starting from
    ``state`` (``policy.init()`` where None).

    One state whose fields are NumPy arrays with the step on the leading axis:
    ``states.scale[t]`` is the scale after step ``t``, ``states.scale[-1]`` the final one.
    One compile per policy (it must be hashable) and sequence length.
    """
    state = policy.init() if state is None else state
    states = _scan_policy(policy, state, jnp.asarray(np.asarray(flags, bool)))
    return jax.tree_util.tree_map(np.asarray, states)


# --------------------------------------------------------------------------
# The small MLP whose steps the formulation and lowering tests compile.


def mlp_params() -> dict[str, jax.Array]:
    """float32 parameters of a 32-64-8 MLP, drawn from a fixed seed."""
    rng = np.random.default_rng(0)
    return {
        "w0": jnp.asarray(rng.normal(0, 0.18, (32, 64)), jnp.float32),
        "b0": jnp.zeros(64, jnp.float32),
        "w1": jnp.asarray(rng.normal(0, 0.13, (64, 8)), jnp.float32),
    }


def mlp_loss(p16: Any, x: Any, y: Any) -> jax.Array:
    """The MLP's squared error, in the parameters' dtype, returned float32."""
    h = jax.nn.relu(x @ p16["w0"] + p16["b0"])
    return jnp.mean((h @ p16["w1"] - y) ** 2).astype(jnp.float32)


def mlp_step(tx: Any, fused: bool = False) -> Any:
    """The README's step on the MLP: float16 forward and backward of float32 parameters,
    ``lsj.value_and_grad``, then ``tx`` through the Optax path (or ``lsj.apply_gradients``,
    ``fused``). ``(params, state, x, y) -> (params, state)``, not jitted."""
    import optax

    import lossscale_jax as lsj

    def step(params: Any, state: Any, x: Any, y: Any) -> Any:
        p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), params)
        _, grads = lsj.value_and_grad(mlp_loss, state)(p16, x, y)
        if fused:
            return lsj.apply_gradients(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


# --------------------------------------------------------------------------
# The repository's scripts as modules.


@functools.cache
def load_script(relative_path: str) -> ModuleType:
    """The script at ``ROOT / relative_path``, imported once per test process.

    It is registered in ``sys.modules`` under ``script_<stem>`` before it runs: Flax modules
    are dataclasses, which look their own module up while the class is being made.
    """
    path = ROOT / relative_path
    name = f"script_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def import_benchmark(module: str) -> ModuleType:
    """``bench.<module>``, a module of the benchmark's package (benchmarks/bench/).

    ``benchmarks/`` goes on ``sys.path`` as ``python benchmarks/bench_step.py`` puts it there.
    """
    path = str(ROOT / "benchmarks")
    if path not in sys.path:
        sys.path.append(path)
    return importlib.import_module(f"bench.{module}")


def run_python(code: str) -> str:
    """``code`` (dedented) run by a fresh interpreter on the CPU, with no PATH: what it prints,
    stripped; the test fails with its stderr if it exits with an error."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={"JAX_PLATFORMS": "cpu", "PATH": ""},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()
