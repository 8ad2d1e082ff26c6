"""The step lowered for a platform this process may lack: each platform gets its own program.

A training step is often compiled where it does not run: ``jax.export`` with
``platforms=("cuda",)``, ahead-of-time compilation on a CPU host, the benchmark's
``--compile-for``. The skip's formulation and the CPU's fence are chosen by the platform the step
is lowered for (``engine/_skip.py``, ``engine/_platform.py``), so from this CPU-only process:

- lowered for ``cuda`` or ``rocm``, the README's step, the fused step and a window step hold a
  select per leaf, no conditional on a value of the step (on XLA:GPU a conditional copies its
  predicate to the host every step) and no ``optimization_barrier`` (which would cut the select
  out of the optimizer's kernels), by default and with ``LOSSSCALE_JAX_SKIP=select``;
- lowered for the CPU they are the CPU's program: by default the one the conditional alone
  compiles to, instruction for instruction; under the select, fenced. The bits of the two
  formulations on XLA:CPU are ``tests/test_formulations.py``'s.

The StableHLO text is read: no GPU and no plugin needed. A step that keeps every formulation
(nothing forced) holds ``platform_dependent``'s switch, a ``case`` on a constant that JAX writes
and XLA folds before it compiles; :func:`runtime_conditionals` counts the others.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mlp_params as params_of
from helpers import mlp_step

import lossscale_jax as lsj
from lossscale_jax.engine import _skip
from lossscale_jax.engine._platform import fence_on_cpu, one_kernel_on_cpu

FRONTS = ("readme", "fused", "window_3")
SKIPS = ("default", "select")

_CASE = re.compile(r'^(\s*)(%[\w#:]+) = "stablehlo\.case"\((%[\w#]+)\)')
_CONSTANT = re.compile(r"^\s*(%[\w]+) = stablehlo\.constant ")
_RETURN = re.compile(r"^\s*stablehlo\.return (.*?) :")


def runtime_conditionals(text: str) -> int:
    """The ``stablehlo.case`` ops of ``text`` whose index is a value of the step.

    Not counted: a case whose index is a constant, or the result of such a case whose every
    branch returns a constant (``platform_dependent`` lowered for one platform writes both: the
    platform's index, then the kept branch alone, on that index). A ``lax.cond`` on a value of
    the step is counted (its index is the predicate, converted)."""
    lines = text.splitlines()
    constant: set[str] = set()
    runtime = 0
    for n, line in enumerate(lines):
        m = _CONSTANT.match(line)
        if m:
            constant.add(m.group(1))
            continue
        m = _CASE.match(line)
        if not m:
            continue
        indent, result, index = m.groups()
        if index.split("#")[0] not in constant:
            runtime += 1
            continue
        # The branches: the lines until the case closes at its own indentation.
        body, returns_constants = [], True
        for inner in lines[n + 1 :]:
            if inner.startswith(indent + "})"):
                break
            body.append(inner)
        local: set[str] = set()  # the branches' own constants
        for inner in body:
            c, r = _CONSTANT.match(inner), _RETURN.match(inner)
            if c:
                local.add(c.group(1))
            elif r:
                returned = (v.strip() for v in r.group(1).split(","))
                returns_constants &= all(v in local or v in constant for v in returned)
            elif inner.strip() not in ("}, {", ""):
                returns_constants = False
        if returns_constants:
            constant.add(result.split(":")[0])
    return runtime


def traced(front: str):
    """The README's step (``tx.update`` and ``optax.apply_updates``), the fused step or a window
    of 3, backward pass and update in one ``jit``: traced, not yet lowered."""
    if front == "window_3":
        tx = lsj.loss_scaling_multi_steps(optax.adam(1e-3), lsj.DynamicScale(), 3)
    else:
        tx = lsj.loss_scaling(optax.adam(1e-3), lsj.DynamicScale())

    step = mlp_step(tx, fused=front == "fused")

    x, y = jnp.ones((16, 32), jnp.float16), jnp.ones((16, 8), jnp.float16)
    return jax.jit(step).trace(params_of(), tx.init(params_of()), x, y)


def _skip_env(monkeypatch, skip: str) -> None:
    if skip == "default":
        monkeypatch.delenv(_skip.ENV, raising=False)
    else:
        monkeypatch.setenv(_skip.ENV, skip)


@pytest.mark.parametrize("skip", SKIPS)
@pytest.mark.parametrize("platform", ["cuda", "rocm"])
@pytest.mark.parametrize("front", FRONTS)
def test_lowered_for_a_gpu_the_step_is_the_select_unfenced(monkeypatch, front, platform, skip):
    _skip_env(monkeypatch, skip)
    text = traced(front).lower(lowering_platforms=(platform,)).as_text()
    assert runtime_conditionals(text) == 0, front
    assert "optimization_barrier" not in text
    assert "stablehlo.select" in text  # the skip: a select per leaf


@pytest.mark.parametrize("front", FRONTS)
def test_the_reader_sees_the_conditional_a_gpu_is_spared(monkeypatch, front):
    # What the test above guards against: the conditional (forced here; before, what a
    # CPU-only process traced and lowered for a GPU) is a conditional on the step's values,
    # and the select lowered for the CPU is fenced.
    monkeypatch.setenv(_skip.ENV, "cond")
    cuda = traced(front).lower(lowering_platforms=("cuda",)).as_text()
    assert runtime_conditionals(cuda) == (2 if front == "window_3" else 1)
    monkeypatch.setenv(_skip.ENV, "select")
    cpu = traced(front).lower(lowering_platforms=("cpu",)).as_text()
    assert runtime_conditionals(cpu) == 0
    assert cpu.count("stablehlo.optimization_barrier") == (4 if front == "window_3" else 2)


def test_the_reader_on_platform_dependent_and_cond():
    """By hand: ``platform_dependent`` lowered for one platform is no conditional of the step's
    values; lowered for two it is (its index is an argument of the program, the platform's, which
    the compiler binds); a ``lax.cond`` on an argument is one."""

    def picked(x):
        return jax.lax.platform_dependent(x, cpu=lambda v: v + 1, default=lambda v: v * 2)

    def conditional(p, x):
        return jax.lax.cond(p, lambda v: v + 1, lambda v: v * 2, x)

    x = jnp.ones(3)
    for platforms in (("cuda",), ("cpu",), ("cpu", "cuda")):
        text = jax.jit(picked).trace(x).lower(lowering_platforms=platforms).as_text()
        assert "stablehlo.case" in text
        assert (runtime_conditionals(text) > 0) == (len(platforms) > 1), platforms
    text = jax.jit(conditional).trace(True, x).lower(lowering_platforms=("cuda",)).as_text()
    assert runtime_conditionals(text) == 1


def _instructions(text: str) -> list[str]:
    """The optimized HLO's instructions, names and metadata taken out: what XLA compiled."""
    out = []
    for line in text.splitlines():
        if " = " not in line:
            continue
        line = re.sub(r", metadata=\{.*?\}(?=, [a-z_]+=|$)", "", line)
        line = re.sub(r"%[\w.\-]+", "%", line)
        out.append(re.sub(r"\b(calls|to_apply|branch_computations)=\S+", r"\1=", line))
    return out


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's program")
@pytest.mark.parametrize("front", FRONTS)
def test_lowered_for_the_cpu_the_step_is_the_conditionals(monkeypatch, front):
    # Nothing forced, the step holds both formulations; XLA:CPU compiles what the conditional
    # alone compiles to, instruction for instruction.
    monkeypatch.delenv(_skip.ENV, raising=False)
    both = traced(front)
    assert "platform_index" in str(both.jaxpr)
    with _skip.formulation("cond"):
        alone = traced(front)
    assert "platform_index" not in str(alone.jaxpr)
    compiled = [t.lower(lowering_platforms=("cpu",)).compile().as_text() for t in (both, alone)]
    assert _instructions(compiled[0]) == _instructions(compiled[1])
    assert compiled[0].count(" conditional(") == (2 if front == "window_3" else 1)
    # A TPU keeps the conditional too.
    tpu = both.lower(lowering_platforms=("tpu",)).as_text()
    assert runtime_conditionals(tpu) >= 1 and "optimization_barrier" not in tpu


def readme_update_step():
    """The README's update (``tx.update``, ``apply_updates``) on the MLP's float16
    gradients: the step and its arguments."""
    tx = lsj.loss_scaling(optax.adam(1e-3), lsj.DynamicScale())

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    grads = jax.tree.map(lambda a: a.astype(jnp.float16), params_of())
    return step, (params_of(), tx.init(params_of()), grads)


def test_jax_export_for_cuda_from_this_process(monkeypatch):
    """What a user runs to ship a step to a GPU machine: ``jax.export`` for ``cuda``."""
    monkeypatch.delenv(_skip.ENV, raising=False)
    step, args = readme_update_step()
    exported = jax.export.export(jax.jit(step), platforms=("cuda",))(*args)
    text = exported.mlir_module()
    assert exported.platforms == ("cuda",)
    assert runtime_conditionals(text) == 0 and "optimization_barrier" not in text


def test_the_fence_is_the_identity_and_a_barrier_on_the_cpu_alone():
    """``fence_on_cpu``: the same values eagerly, under ``jit``, ``vmap`` and ``grad``; lowered
    for the CPU one ``optimization_barrier`` over the leaves, lowered for a GPU none."""

    def f(x, y):
        a, b = fence_on_cpu((x * 2.0, y))
        return a + b

    x, y = jnp.arange(3.0), jnp.ones(3)
    want = np.asarray(x * 2.0 + y)
    assert np.array_equal(f(x, y), want) and np.array_equal(jax.jit(f)(x, y), want)
    batched = jax.vmap(f)(jnp.stack([x, x]), jnp.stack([y, y]))
    assert np.array_equal(batched, np.stack([want, want]))
    assert np.array_equal(jax.jit(jax.grad(lambda v: f(v, v).sum()))(x), np.full(3, 3.0))
    traced_f = jax.jit(f).trace(x, y)
    cpu = traced_f.lower(lowering_platforms=("cpu",)).as_text()
    assert cpu.count("stablehlo.optimization_barrier") == 1
    for platform in ("cuda", "rocm", "tpu"):
        text = traced_f.lower(lowering_platforms=(platform,)).as_text()
        assert "optimization_barrier" not in text and "stablehlo.case" not in text
    assert fence_on_cpu(()) == () and fence_on_cpu({"a": None}) == {"a": None}


def test_one_kernel_is_the_identity_bit_for_bit_and_a_reduction_on_the_cpu_alone():
    """``one_kernel_on_cpu``: each value as it was, bit for bit (NaN, -0.0, the infinities, a
    subnormal, the integers' ends, flags; float16, bfloat16, unsigned), eagerly, under ``jit``,
    ``vmap`` and ``grad``; lowered for the CPU one variadic reduction per shape shared by two or
    more leaves, lowered for any other platform none."""
    f32 = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-45, 3.5], np.float32)
    tree = {
        "f32": [jnp.asarray(v) for v in f32],
        "i32": [jnp.int32(np.iinfo(np.int32).min), jnp.int32(np.iinfo(np.int32).max)],
        "flags": [jnp.bool_(True), jnp.bool_(False)],
        "small": [jnp.float16(-0.0), jnp.bfloat16(np.nan), jnp.uint8(255)],
        "rows": [jnp.asarray(f32), jnp.arange(6, dtype=jnp.int32) - 3],  # a shape of their own
        "alone": jnp.zeros((2, 2), jnp.complex64),  # no max: passed as it is
    }

    def bits(t):
        return [np.asarray(x).tobytes() for x in jax.tree.leaves(t)]

    for got in (one_kernel_on_cpu(tree), jax.jit(one_kernel_on_cpu)(tree)):
        assert bits(got) == bits(tree)
        assert [x.dtype for x in jax.tree.leaves(got)] == [x.dtype for x in jax.tree.leaves(tree)]
    rows = jnp.stack([jnp.asarray(f32), jnp.asarray(f32[::-1])])
    batched = jax.jit(jax.vmap(lambda r: one_kernel_on_cpu((r, r[0], r[1]))))(rows)
    assert bits(batched) == bits((rows, rows[:, 0], rows[:, 1]))
    grad = jax.jit(jax.grad(lambda x: sum(one_kernel_on_cpu((x * 2.0, x * 3.0)))))(3.0)
    assert float(grad) == 5.0

    traced = jax.jit(one_kernel_on_cpu).trace(tree)
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert cpu.count("stablehlo.reduce") == 2  # the scalars and the two rows; not "alone"
    for platform in ("cuda", "rocm", "tpu"):
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert "stablehlo.reduce" not in text and "stablehlo.case" not in text
    assert one_kernel_on_cpu(()) == () and bits(one_kernel_on_cpu([f32[0]])) == bits([f32[0]])


def test_the_conditionals_operands_are_row_major_on_the_cpu_unless_exported(monkeypatch):
    """Lowered by ``jit`` for the CPU, the conditional's operands carry a layout constraint to
    row-major (``engine/_platform.row_major_on_cpu``: no transposing copy in the branch);
    ``jax.export``, which refuses the constraint's custom call, gets none, for the CPU alone
    and beside ``cuda``, and the exported step runs here to the same bits as the jitted one."""
    monkeypatch.delenv(_skip.ENV, raising=False)
    step, args = readme_update_step()
    assert "LayoutConstraint" in jax.jit(step).lower(*args).as_text()
    want = jax.jit(step)(*args)
    for platforms in (("cpu",), ("cpu", "cuda")):
        exported = jax.export.export(jax.jit(step), platforms=platforms)(*args)
        assert "LayoutConstraint" not in exported.mlir_module()
        got = exported.call(*args)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))
