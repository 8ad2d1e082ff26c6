"""The fused step and the structure of the compiled step.

The fused step (`apply_gradients`) is checked bit for bit against the Optax
path (`tx.update` + `optax.apply_updates`). The compiled step is checked from
its HLO: one conditional, no whole-tree select, no parameter-sized copy, at
most one extra read of each gradient leaf compared with a plain step, and
temporary memory within one byte per parameter of the plain step.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import pkgutil
import re
import shutil
import subprocess
import sys
from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (  # tests/ is on sys.path under pytest
    ROOT,
    assert_bits_equal,
    assert_step_within_ulps,
    import_benchmark,
    load_script,
    programs_round_alike,
)

import lossscale_jax as lsj
from lossscale_jax.engine import _engine
from lossscale_jax.engine._platform import one_kernel_on_cpu
from lossscale_jax.errors import Float16OptimizerWarning

# The benchmark's package (benchmarks/bench/): its HLO reader serves the tests below too.
breakdowns = import_benchmark("breakdowns")
cli = import_benchmark("cli")
gpu = import_benchmark("gpu")
harness = import_benchmark("harness")
hlo = import_benchmark("hlo")
profiling = import_benchmark("profiling")
prototypes = import_benchmark("prototypes")
report = import_benchmark("report")
variants = import_benchmark("variants")
workloads = import_benchmark("workloads")


# Tests that assert facts of XLA:CPU's optimized HLO (its conditionals, fusions, selects): the
# suite also runs on a GPU (JAX_PLATFORMS=cuda,cpu), where XLA:GPU compiles the step otherwise.
def cpu_hlo(test):
    """Reads XLA:CPU's optimized HLO of the steps a CPU runs: skipped on another backend, and
    with the CPU's own skip formulation whatever LOSSSCALE_JAX_SKIP forces (conftest.py)."""
    test = pytest.mark.usefixtures("platform_formulation")(test)
    return pytest.mark.skipif(
        jax.default_backend() != "cpu", reason="reads XLA:CPU's optimized HLO"
    )(test)


def _params(rng: np.random.Generator, dtype) -> dict:
    return {
        "w1": jnp.asarray(rng.normal(size=(24, 16)), dtype),
        "b1": jnp.asarray(rng.normal(size=(16,)), dtype),
        "w2": jnp.asarray(rng.normal(size=(16, 4)), dtype),
    }


# (inner, policy, overflow mode, param dtype, bad value injected on step 2)
CASES = {
    "adamw-dynamic-ieee-fp32master": (
        optax.adamw(1e-2, weight_decay=1e-2),
        lsj.DynamicScale(init_scale=2.0**12, growth_interval=2),
        "ieee",
        jnp.float32,
        np.inf,
    ),
    "chain-momentum-static-saturating-fp16": (
        optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-2, momentum=0.9)),
        lsj.StaticScale(2.0**8),
        "saturating",
        jnp.float16,
        65504.0,
    ),
    "adam-noscale-both-bf16": (
        optax.adam(1e-2),
        lsj.NoScale(skip_on_overflow=True),
        "both",
        jnp.bfloat16,
        np.nan,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_step_matches_the_optax_path(case):
    inner, policy, mode, dtype, bad = CASES[case]
    rng = np.random.default_rng(0)
    params = _params(rng, dtype)
    tx = lsj.loss_scaling(inner, policy, overflow=mode)

    @jax.jit
    def optax_step(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    @jax.jit
    def fused_step(p, s, g):
        return lsj.apply_gradients(tx, g, s, p)

    # Bit for bit where the two programs round the update alike (XLA:CPU with the conditional);
    # under a select, each step from the same state within one ulp (helpers).
    alike = programs_round_alike()
    # float16 parameters under an inner running in float16: its init says so (the landing
    # check keeps inf out of them; the cases' updates land finite).
    with pytest.warns(Float16OptimizerWarning) if dtype == jnp.float16 else nullcontext():
        state = tx.init(params)
    ref = (params, state)
    out = (params, state)
    skipped = []
    for step in range(5):
        grads = {
            k: jnp.asarray(rng.normal(size=v.shape) * 30.0, jnp.float16) for k, v in params.items()
        }
        if step == 2:
            grads["b1"] = grads["b1"].at[3].set(bad)
        before = ref
        ref = optax_step(*ref, grads)
        out = fused_step(*(out if alike else before), grads)
        if alike:
            assert_bits_equal(out, ref)
        else:
            assert_step_within_ulps(out, ref, before, 1, f"step {step}")
            assert_bits_equal(out[1].loss_scale, ref[1].loss_scale)
        skipped.append(bool(ref[1].loss_scale.last_skipped))
    # The comparison covered good steps and the skipped one.
    assert skipped == [False, False, True, False, False]


def test_fused_step_rejects_a_wrapped_transformation():
    tx = optax.chain(lsj.loss_scaling(optax.sgd(0.1), lsj.StaticScale(2.0)))
    params = {"w": jnp.ones(2)}
    with pytest.raises(TypeError, match="tx must be the transformation returned by"):
        lsj.apply_gradients(tx, params, tx.init(params), params)


def test_fused_step_traces_once_and_never_touches_the_host():
    params = _params(np.random.default_rng(1), jnp.float32)
    tx = lsj.loss_scaling(optax.adam(1e-3), lsj.DynamicScale(init_scale=2.0**4, growth_interval=1))
    traces = {"fused": 0, "optax": 0}

    def fused(p, s, g):
        traces["fused"] += 1
        return lsj.apply_gradients(tx, g, s, p)

    def plain_optax(p, s, g):
        traces["optax"] += 1
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    grads = jax.device_put(jax.tree_util.tree_map(lambda x: x.astype(jnp.float16), params))
    for fn in (fused, plain_optax):
        step = jax.jit(fn, donate_argnums=(0, 1))
        p, s = jax.tree_util.tree_map(jnp.copy, (params, tx.init(params)))  # donated below
        with jax.transfer_guard("disallow"):
            for _ in range(3):  # grows the scale every step: new values, same trace
                p, s = step(p, s, grads)
        jax.block_until_ready((p, s))
    assert traces == {"fused": 1, "optax": 1}


# --------------------------------------------------------------------------
# The compiled step, read from its HLO (with the benchmark's reader, benchmarks/bench/hlo.py).


def _steps(tx, inner):
    def plain(params, state, grads):
        updates, state = inner.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def optax_path(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def fused(params, state, grads):
        return lsj.apply_gradients(tx, grads, state, params)

    return {"plain": (plain, inner.init), "optax": (optax_path, tx.init), "fused": (fused, tx.init)}


def _compile(fn, init, params, grads):
    return jax.jit(fn, donate_argnums=(0, 1)).lower(params, init(params), grads).compile()


def _good_step_kernels(text: str, op: str, shapes: set[str]) -> int:
    """How many ``op`` instructions of a shape in ``shapes`` a good step runs as kernels of
    their own: in the entry computation and in each conditional's good branch (JAX's
    ``lax.cond`` passes the predicate as the index: branch 1 is the true one), not fused."""
    comps, entry = hlo.parse_hlo(text)

    def walk(comp: str) -> int:
        n = 0
        for ins in comps[comp]:
            if ins["op"] == "conditional":
                n += walk(hlo.branches(ins)[-1])
            elif ins["op"] == op and ins["shape"] in shapes:
                n += 1
        return n

    return walk(entry)


@cpu_hlo
def test_the_optax_paths_skip_branch_builds_no_update():
    """A skipped step of the Optax path passes the parameters through the conditional in place
    of its updates and makes them -0.0 after the decision: its skip branch computes nothing
    (XLA:CPU compiles each kernel of a branch, some 20 ms each, though a skipped step alone runs
    it), and the updates are -0.0 all the same: with the parameters given, without them (the
    -0.0 built in the branch), and for a leaf whose parameter has another dtype."""
    rng = np.random.default_rng(5)
    params = _params(rng, jnp.float32)
    grads = jax.tree_util.tree_map(lambda p: p.astype(jnp.float16), params)
    inner = optax.adam(1e-3)
    tx = lsj.loss_scaling(inner, lsj.DynamicScale())
    text = _compile(_steps(tx, inner)["optax"][0], tx.init, params, grads).as_text()
    comps, entry = hlo.parse_hlo(text)
    (cond,) = [i for c in comps.values() for i in c if i["op"] == "conditional"]
    skip_branch = hlo.branches(cond)[0]
    kernels = [i["op"] for i in comps[skip_branch] if i["op"] not in ("parameter", "tuple")]
    assert set(kernels) <= {"get-tuple-element", "copy", "bitcast"}, kernels

    bad = jax.tree_util.tree_map(lambda g: g.at[(0,) * g.ndim].set(jnp.inf), grads)
    state = tx.init(params)
    bf16 = {**params, "b1": params["b1"].astype(jnp.bfloat16)}  # not the updates' dtype
    for given in (params, None, bf16):
        updates, new = jax.jit(tx.update)(bad, state, given)
        assert bool(new.loss_scale.last_skipped)
        for u in jax.tree_util.tree_leaves(updates):
            assert u.dtype == jnp.float32 and bool(jnp.all(u == 0) & jnp.all(jnp.signbit(u)))


@cpu_hlo
@pytest.mark.parametrize("policy", [lsj.DynamicScale(), lsj.HeadroomScale()], ids=type)
def test_the_steps_loss_scale_state_is_one_kernel(policy, monkeypatch):
    """XLA:CPU computes the loss-scale state a step returns in one kernel (a variadic
    reduction of its twelve fields, ``engine/_platform.one_kernel_on_cpu``), not a kernel per
    field, each some 20 ms of the first call's compile: on the Optax path and the fused step,
    the same state as the step compiled without it, bit for bit (a good step and an
    overflowing one)."""
    rng = np.random.default_rng(4)
    params = _params(rng, jnp.float32)
    grads = jax.tree_util.tree_map(lambda p: p.astype(jnp.float16), params)
    inf = jax.tree_util.tree_map(lambda x: x.at[0].set(jnp.inf), grads)
    inner = optax.adam(1e-3)
    tx = lsj.loss_scaling(inner, policy)
    n_fields = len(jax.tree_util.tree_leaves(tx.init(params).loss_scale))
    steps = {k: v for k, v in _steps(tx, inner).items() if k != "plain"}
    states = {}
    for name, (fn, init) in steps.items():
        comps, entry = hlo.parse_hlo(_compile(fn, init, params, grads).as_text())
        fields = [
            i["shape"].count("[]")
            for i in comps[entry]
            if i["op"] == "fusion" and i["shape"].startswith("(")
        ]
        assert max(fields) >= n_fields, (name, fields)  # the state's, and the step's apply
        step = jax.jit(fn)  # not donated: the inputs are read again
        states[name] = [step(params, init(params), g)[1].loss_scale for g in (grads, inf)]
        assert bool(states[name][1].last_overflow) and not bool(states[name][0].last_overflow)
    monkeypatch.setattr(_engine, "one_kernel_on_cpu", lambda tree: tree)  # a kernel a field
    jax.clear_caches()  # the steps traced again, without it
    for name, (fn, init) in steps.items():
        step = jax.jit(fn)
        assert "one_kernel" not in str(step.trace(params, init(params), grads).jaxpr), name
        for got, g in zip(states[name], (grads, inf), strict=True):
            assert_bits_equal(got, step(params, init(params), g)[1].loss_scale, name)


@cpu_hlo
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ieee", "saturating"])
def test_compiled_step_reads_each_gradient_once_more_than_a_plain_step(mode):
    rng = np.random.default_rng(2)
    params = {
        k: jnp.asarray(rng.normal(size=s), jnp.float32)
        for k, s in [("a", (256, 128)), ("b", (128,)), ("c", (128, 64)), ("d", (64,))]
    }
    grads = jax.tree_util.tree_map(lambda p: p.astype(jnp.float16), params)
    inner = optax.adam(1e-3)
    tx = lsj.loss_scaling(inner, lsj.DynamicScale(), overflow=mode)
    texts, temps = {}, {}
    for name, (fn, init) in _steps(tx, inner).items():
        compiled = _compile(fn, init, params, grads)
        texts[name] = compiled.as_text()
        temps[name] = compiled.memory_analysis().temp_size_in_bytes
    # Parameter- and moment-sized shapes (float32) and the gradients' (float16).
    big = hlo.shape_strings(params)
    n_params = sum(p.size for p in params.values())
    for name in ("optax", "fused"):
        text = texts[name]
        assert hlo.count(text, "conditional") == 1, name  # the skip is one conditional
        # No whole-tree select and no parameter-sized copy in what a good step runs: the
        # Optax path's where(apply, u, -0.0) is fused into apply_updates' add, and the
        # parameters it passes through a skipped step are copied in the skip branch alone.
        assert _good_step_kernels(text, "select", big) == 0, name
        assert _good_step_kernels(text, "copy", big) == 0, name
        assert hlo.count(text, "copy", big) <= (len(params) if name == "optax" else 0), name
        for k in params:
            plain_reads = hlo.reads(texts["plain"], f"grads['{k}']")
            assert plain_reads >= 1
            assert hlo.reads(text, f"grads['{k}']") <= plain_reads + 1, (name, k)
    assert hlo.count(texts["plain"], "conditional") == 0
    # The fused step needs no parameter-sized temporary beyond plain: the check fuses
    # into its reduction (no mask is written), leaving a few scalars: the loss-scale state's
    # among them, each a 64-byte buffer of its own in a donated step (XLA:CPU computes them
    # in one kernel, which cannot write into the donated buffers it reads). A float16
    # gradient of "a" or "c", or a mask of one, is 8 KiB or more.
    assert temps["fused"] <= temps["plain"] + 4096, (temps, n_params)


@cpu_hlo
@pytest.mark.parametrize("mode", ["ieee", "saturating", "both"])
def test_overflow_check_is_one_fused_read_per_leaf(mode):
    """No mask or partial result of a gradient's size is written: each gradient leaf is
    read by one instruction, same-shape leaves share one reduction kernel, and the
    temporaries are a few bytes (the old two-stage form wrote 1 byte per element)."""
    rng = np.random.default_rng(3)
    grads = {"big": jnp.asarray(rng.normal(size=(512, 1024)), jnp.float16)}
    grads |= {f"l{i:02d}": jnp.asarray(rng.normal(size=(64, 48)), jnp.float32) for i in range(20)}
    n = sum(g.size for g in grads.values())

    def check(grads):
        return lsj.check_overflow(grads, mode), lsj.numerics.overflow_flags(grads, mode)

    compiled = jax.jit(check).lower(grads).compile()
    text = compiled.as_text()
    assert compiled.memory_analysis().temp_size_in_bytes < 4096 < n // 100
    for k in grads:
        assert hlo.reads(text, f"grads['{k}']") == 1, k
    comps, entry = hlo.parse_hlo(text)
    reading = {
        i["name"]
        for i in comps[entry]
        if i["op"] == "fusion"
        and i["operands"]
        and all(o.startswith("grads") for o in i["operands"])
    }
    # One kernel for the big leaf, two for the 20 same-shape leaves (16 + 4).
    assert len(reading) == 3, sorted(reading)


@cpu_hlo
def test_hlo_reader_sees_a_whole_tree_select():
    """The HLO checks above can fail: jmp's select_tree is caught by them."""
    import jmp

    params = {"a": jnp.ones((64, 32), jnp.float32), "b": jnp.ones((32,), jnp.float32)}
    grads = jax.tree_util.tree_map(lambda p: p.astype(jnp.float16), params)
    inner = optax.adam(1e-3)

    def jmp_step(params, state, grads):
        grads = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32) / 1024.0, grads)
        finite = jmp.all_finite(grads)
        updates, new_state = inner.update(grads, state, params)
        new_params = optax.apply_updates(params, updates)
        return jmp.select_tree(finite, (new_params, new_state), (params, state))

    text = _compile(jmp_step, inner.init, params, grads).as_text()
    assert hlo.count(text, "select", {"f32[64,32]", "f32[32]"}) >= 6  # params, mu, nu x 2 leaves
    assert hlo.reads(text, "grads['a']") >= 1


@pytest.mark.skipif(  # JAX names a CUDA or ROCm backend "gpu"
    jax.default_backend() != "gpu", reason="XLA:GPU's program: make test-gpu"
)
@pytest.mark.parametrize("fused", [False, True], ids=["optax_path", "fused"])
def test_on_a_gpu_the_step_has_no_conditional_and_copies_nothing(fused):
    """XLA:GPU resolves a conditional on the host (it copies the predicate back and waits for
    it), and with the buffers donated it copied every parameter and moment out of the fused
    step's conditional (jaxlib 0.10.2): the select formulation the GPU takes has neither."""
    params = {"a": jnp.ones((256, 128), jnp.float32), "b": jnp.ones((128,), jnp.float32)}
    grads = jax.tree_util.tree_map(lambda p: p.astype(jnp.float16), params)
    tx = lsj.loss_scaling(optax.adam(1e-3), lsj.DynamicScale())

    def step(params, state, grads):
        if fused:
            return lsj.apply_gradients(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    stats = hlo.hlo_stats(_compile(step, tx.init, params, grads).as_text(), {"f32[256,128]"})
    assert stats["conditionals"] == 0 and stats["param_sized_copies"] == 0, stats
    assert stats["param_sized_selects"] >= 3, stats  # params, mu, nu: selected where computed


@pytest.mark.slow
def test_compiled_step_size_grows_linearly_with_the_leaf_count():
    def instructions(n_leaves: int) -> int:
        # Shapes, not arrays: the step compiles as from arrays of these shapes (the same HLO),
        # without an eager fill and cast compiled per leaf shape (80 small programs).
        params = {f"{i:03d}": jax.ShapeDtypeStruct((8 + i,), jnp.float32) for i in range(n_leaves)}
        grads = {k: jax.ShapeDtypeStruct(p.shape, jnp.float16) for k, p in params.items()}
        tx = lsj.loss_scaling(optax.adam(1e-3), lsj.DynamicScale())
        fn, init = _steps(tx, optax.adam(1e-3))["fused"]
        state = jax.eval_shape(init, params)
        compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(params, state, grads).compile()
        return hlo.count(compiled.as_text())

    small, large = instructions(10), instructions(40)
    assert large <= 4.4 * small  # linear (a quadratic pattern would give ~16x)


def _optax_path_selects(row: dict) -> int:
    """The Optax path's per-leaf selects of a benchmark row's step (0 for other steps)."""
    if "optax" not in row["variant"]:
        return 0
    return len(jax.tree_util.tree_leaves(workloads.build_case(row["case"]).params))


@cpu_hlo
@pytest.mark.slow
def test_benchmark_quick_run(tmp_path):
    """`benchmarks/bench_step.py --quick`: every variant, full and post step, stays finite
    with its loss scale unmoved (else the benchmark refuses it), and the table is written."""
    rows = cli.main(["--quick", "--out", str(tmp_path)])
    assert {(r["case"], r["variant"]) for r in rows} == {
        (c, v) for c in workloads.QUICK_CASES for v in variants.DEFAULT_VARIANTS
    }
    plain = {r["case"]: r for r in rows if r["variant"] == "plain"}
    for row in rows:
        assert row["refused"] is None, row
        assert row["median_ms"] > 0 and row["samples"] >= 4
        if row["variant"] == "plain":
            assert row["ratio"] == pytest.approx(1.0)
        if row["variant"].startswith("lsj"):
            # No select beyond the plain step's (in the full step, the backward pass of relu
            # selects on activations that happen to share a parameter's shape), but the Optax
            # path's where(apply, u, -0.0), one per leaf, fused into apply_updates' add.
            selects = plain[row["case"]]["param_sized_selects"] + _optax_path_selects(row)
            assert row["conditionals"] == 1 and row["param_sized_selects"] == selects, row
    post = {r["variant"]: r for r in rows if r["kind"] == "post"}
    for v in post:
        if v.startswith("lsj"):
            # The parameters the Optax path passes through a skipped step are copied in the
            # skip branch alone (a good step copies nothing: test_compiled_step_reads_...).
            assert post[v]["param_sized_copies"] == _optax_path_selects(post[v])
            assert post[v]["param_sized_selects"] == _optax_path_selects(post[v])
    # The peers' whole-tree selects show up in the same counters.
    assert post["jmp"]["param_sized_selects"] > 0 and post["flax"]["param_sized_selects"] > 0
    # One more read of the float16 gradients (2 B/param) than plain, in the HLO estimate.
    n = post["plain"]["params"]
    extra = (post["lsj_fused_ieee"]["bytes_moved"] - post["plain"]["bytes_moved"]) / n
    assert 1.5 <= extra <= 2.5, extra
    table = (tmp_path / "results.md").read_text()
    assert "| lsj_fused_ieee |" in table and (tmp_path / "results.json").exists()


@pytest.mark.slow
def test_benchmark_compile_report_builds_the_step_up_and_renders(monkeypatch, tmp_path):
    """The compile-time breakdown: every piece compiles, the skeleton skips like the library
    (no update on an inf gradient), and its table lands in the marked block of a doc."""
    monkeypatch.setattr(breakdowns, "COMPILE_REPEATS", 1)
    rows = breakdowns.compile_report("tiny", lambda m: None)
    assert [r["step"] for r in rows] == [
        "plain",
        "skel_unscale",
        "skel_cond",
        "skel_check_cond",
        "lsj_fused_ieee",
        "lsj_optax_ieee",
        "optax_if_finite",
    ]
    assert rows[0]["x_plain"] == 1.0
    assert all(r["compile_cpu_s"] > 0 and len(r["all_s"]) == 1 for r in rows)
    # The skeleton is a real skip step: an inf leaves params and state as they were, and the
    # per-leaf record names the leaf.
    _, step, init = breakdowns.skeletons()["skel_check_cond"]
    params = workloads.init_params(workloads.WORKLOADS["tiny"], "in_out", np.random.default_rng(0))
    grads = workloads.to16(params)
    state = init(params)
    bad = dict(grads, **{"002": grads["002"].at[0, 0].set(jnp.inf)})
    kept, kept_state, flags = jax.jit(step)(params, state, bad)
    assert_bits_equal((kept, kept_state), (params, state))
    assert np.asarray(flags).tolist() == [k == "002" for k in sorted(params)]
    moved, _, flags = jax.jit(step)(params, state, grads)
    assert not np.asarray(flags).any() and not np.array_equal(moved["000"], params["000"])
    doc = tmp_path / "performance.md"
    begin, end = report.markers("compile")
    doc.write_text(f"before\n{begin}\nold\n{end}\nafter\n")
    meta = {"compile_report": rows, "rounds": 1, "iters": 1, "command": "c", "machine": "m"}
    meta.update(load_before="0", load_after="0", allocators=["default"], check_report=None)
    assert "compile" in report.update_docs([], meta, doc)
    text = doc.read_text()
    assert "old" not in text and "| skel_check_cond |" in text and text.endswith("after\n")


@pytest.mark.slow
def test_benchmark_command_renders_the_saved_run(tmp_path):
    """`python benchmarks/bench_step.py --render`, the one command run as a process, writes
    from results.json the results.md committed next to it, byte for byte."""
    shutil.copy(ROOT / "benchmarks" / "results.json", tmp_path)
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_step.py")]
    # The package as this process imports it: from the checkout (installed or not: a GPU
    # machine runs the suite from the source tree).
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    subprocess.run([*command, "--render", "--out", str(tmp_path)], check=True, env=env)
    assert (tmp_path / "results.md").read_bytes() == (
        ROOT / "benchmarks" / "results.md"
    ).read_bytes()


@pytest.mark.slow
def test_negative_zero_skip_updates_cost_nothing(monkeypatch):
    """A skipped step's updates are -0.0 (params + updates keeps -0.0 parameters): the same
    compiled step, op for op and byte for byte, as with +0.0 (which would not keep them)."""
    from lossscale_jax.engine import _inner_skip

    rng = np.random.default_rng(3)
    params = _params(rng, jnp.float32)
    params["b1"] = params["b1"].at[0].set(-0.0)
    grads = jax.tree_util.tree_map(lambda p: p.astype(jnp.float16), params)
    bad = jax.tree_util.tree_map(lambda g: g.at[(0,) * g.ndim].set(jnp.inf), grads)
    inner = optax.adam(1e-3)

    def compiled():
        tx = lsj.loss_scaling(inner, lsj.DynamicScale())
        step = _compile(_steps(tx, inner)["optax"][0], tx.init, params, grads)
        copies = jax.tree_util.tree_map(jnp.copy, (params, tx.init(params)))  # donated
        return step, step(*copies, bad)[0]  # a skipped step

    def histogram(text):
        comps, _ = hlo.parse_hlo(text)
        return sorted(
            (i["op"], i["shape"]) for c in comps.values() for i in c if i["op"] != "constant"
        )

    negative, kept = compiled()
    assert_bits_equal(kept, params)  # -0.0 stays -0.0
    plus = _inner_skip._skip_leaf  # what every skipped update is built from
    monkeypatch.setattr(_inner_skip, "_skip_leaf", lambda s: jnp.zeros_like(plus(s)))
    positive, flipped = compiled()
    assert np.signbit(np.asarray(kept["b1"][0])) and not np.signbit(np.asarray(flipped["b1"][0]))
    assert histogram(negative.as_text()) == histogram(positive.as_text())
    mem_n, mem_p = negative.memory_analysis(), positive.memory_analysis()
    assert mem_n.temp_size_in_bytes == mem_p.temp_size_in_bytes


@cpu_hlo
@pytest.mark.slow
def test_benchmark_prototypes_still_trace_and_stay_finite():
    """Every variant outside the default run, the `proto_*` ones (the formulations
    docs/performance.md compares against) and the HeadroomScale steps, runs against the library
    as it is now: each compiles, trains and keeps its scale."""
    full_only = ["lsj_layerwise"]  # its update takes the taps of the backward pass
    names = [
        "plain",
        *(n for n in variants.VARIANTS if n not in (*variants.DEFAULT_VARIANTS, *full_only)),
    ]
    assert set(prototypes.PROTOTYPES) < set(names)  # and the two HeadroomScale steps
    rows = harness.run_case("tiny/in_out/fp16grad/post", names, 1, 1, False, lambda m: None)
    assert [r["variant"] for r in rows] == names
    # One conditional each of the library's steps (XLA:CPU takes the conditional), but the
    # select formulation's, which has none; plain_scaled has no skip, where_skip a select.
    for r in rows[1:]:
        selects = "_select_" in r["variant"] or r["variant"] in ("plain_scaled", "where_skip")
        want = 0 if selects else 1
        assert r["refused"] is None and r["conditionals"] == want, r
    rows = harness.run_case(
        "tiny/in_out/fp16grad/full", ["plain", *full_only], 1, 1, False, lambda m: None
    )
    assert all(r["refused"] is None and r["conditionals"] == 1 for r in rows[1:]), rows


@pytest.mark.slow
def test_the_bare_where_skip_skips_and_otherwise_steps_as_plain_scaled():
    """``where_skip``, the floor of a select skip: on an inf gradient the parameters and
    Adam's state come back bit for bit; on good gradients the step is ``plain_scaled``'s (the
    same unscale and Adam; to float32 rounding, as each compiles on its own)."""
    case = workloads.build_case("tiny/in_out/fp16grad/post")
    post = variants.VARIANTS["where_skip"](case.loss, case.pattern)[1]
    plain_post, init = variants.VARIANTS["plain_scaled"](case.loss, case.pattern)[1:3]
    state = init(case.params)
    (grads,) = case.args
    bad = dict(grads, **{"001": grads["001"].at[0].set(jnp.inf)})
    assert_bits_equal(jax.jit(post)(case.params, state, bad), (case.params, state))
    got, want = (
        jax.jit(post)(case.params, state, grads),
        jax.jit(plain_post)(case.params, state, grads),
    )
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        # The same operations, compiled twice: a multiply and an add may be fused into one
        # rounding in one program and not the other. The second moment is the furthest:
        # the gradient's square, its product by 1 - b2 and the sum, up to 3 roundings apart,
        # and the update and the parameter follow it by less: 4 float32 epsilons bound them.
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=4 * np.finfo(np.float32).eps)
    assert not np.array_equal(got[0]["000"], case.params["000"])


def test_benchmark_refuses_a_diverged_or_skipping_variant(monkeypatch):
    """The refusal can fail a variant: one whose parameters go non-finite, one that skips."""

    def diverging(loss, pattern):
        full, post, init, scale_of = variants.variant_plain(loss, pattern)

        def bad(p, s, g):
            p, s = post(p, s, g)
            return jax.tree_util.tree_map(lambda x: x * jnp.inf, p), s

        return full, bad, init, scale_of

    def skipping(loss, pattern):
        full, post, init, scale_of = variants.variant_lsj(loss, pattern, fused=True, mode="ieee")
        return (
            full,
            lambda p, s, g: post(p, s, jax.tree_util.tree_map(lambda x: x * jnp.inf, g)),
            init,
            scale_of,
        )

    monkeypatch.setitem(variants.VARIANTS, "diverging", diverging)
    monkeypatch.setitem(variants.VARIANTS, "skipping", skipping)
    rows = harness.run_case(
        "tiny/in_out/fp16grad/post", ["plain", "diverging", "skipping"], 1, 1, False, lambda m: None
    )
    refused = {r["variant"]: r["refused"] for r in rows}
    assert refused["plain"] is None
    assert "non-finite parameters" in refused["diverging"]
    assert "loss scale moved" in refused["skipping"]


# --------------------------------------------------------------------------
# The benchmark on an accelerator: XLA:GPU's HLO text, the throughput mode, the language model,
# the GPU results (benchmarks/README.md).

_INDEXED = re.compile(
    r"conditional\((%[\w.\-]+), (%[\w.\-]+), (%[\w.\-]+)\), "
    r"branch_computations=\{(%[\w.\-]+), (%[\w.\-]+)\}"
)


def _as_xla_gpu_prints_it(text: str) -> str:
    """XLA:CPU's two-branch conditional written as XLA:GPU prints it: the index is 0 for
    false, 1 for true, so ``conditional(i, a, b), branch_computations={f, t}`` becomes
    ``conditional(p, b, a), true_computation=t, false_computation=f``."""
    return _INDEXED.sub(r"conditional(\1, \3, \2), true_computation=\5, false_computation=\4", text)


@cpu_hlo
@pytest.mark.slow
def test_hlo_reader_reads_xla_gpu_conditionals():
    """The reader gives the same branches, bytes, counts and reads for a compiled step whose
    conditional is written in XLA:GPU's predicate form as for XLA:CPU's index form."""
    params = _params(np.random.default_rng(4), jnp.float32)
    grads = jax.tree_util.tree_map(lambda p: p.astype(jnp.float16), params)
    tx = lsj.loss_scaling(optax.adam(1e-3), lsj.DynamicScale())
    fn, init = _steps(tx, optax.adam(1e-3))["fused"]
    cpu = _compile(fn, init, params, grads).as_text()
    gpu = _as_xla_gpu_prints_it(cpu)
    assert "branch_computations=" in cpu and "branch_computations=" not in gpu
    assert gpu.count("true_computation=") == cpu.count("branch_computations=") == 1

    def conditionals(text):
        comps, _ = hlo.parse_hlo(text)
        return [i for c in comps.values() for i in c if i["op"] == "conditional"]

    (c_cpu,), (c_gpu,) = conditionals(cpu), conditionals(gpu)
    # Branch k takes operand k + 1 in both forms: the same (operand, branch) pairs.
    pairs = lambda c: sorted(zip(c["operands"][1:], hlo.branches(c), strict=True))  # noqa: E731
    assert pairs(c_gpu) == pairs(c_cpu)
    assert hlo.branches(c_gpu) == hlo.branches(c_cpu)[::-1]
    big = hlo.shape_strings(params)
    assert hlo.hlo_stats(gpu, big) == hlo.hlo_stats(cpu, big)
    for k in params:
        assert hlo.reads(gpu, f"grads['{k}']") == hlo.reads(cpu, f"grads['{k}']") >= 1, k
    with pytest.raises(ValueError, match="neither branch_computations"):
        hlo.branches({"name": "c", "rest": "%p, %a, %b), metadata={}"})


def test_hlo_reader_sizes_xla_gpu_types_and_follows_calls():
    """Element types XLA:CPU rarely prints have sizes, and a computation run by a ``call``
    (XLA:GPU's command buffers) counts in the bytes moved and the reads."""
    assert hlo._shape_bytes("(f8e4m3fn[4,2], c64[3], bf16[2], token[])") == 8 + 24 + 4
    with pytest.raises(ValueError, match="not known"):
        hlo._shape_bytes("zz9[2]")
    text = """ENTRY %main (g: f32[8]) -> f32[8] {
  %g = f32[8]{0} parameter(0), metadata={op_name="grads['w']"}
  ROOT %call = f32[8]{0} call(%g), to_apply=%command_buffer
}
%command_buffer (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %fusion = f32[8]{0} fusion(%p0), kind=kLoop, calls=%fused
}
"""
    assert hlo.reads(text, "grads['w']") == 1
    assert hlo.bytes_moved(text) == 2 * 32


# XLA:GPU's own text: the tiny case's fused post step compiled for an H100 by
# `bench_step.py --compile-for h100 --cases tiny/in_out/fp16grad/post --variants
# lsj_fused_cond_ieee lsj_fused_ieee --hlo-dir ...` (jaxlib 0.10.2, the buffers donated), with
# the debug tables, scheduling names and stack frame ids taken out (the rest unchanged).
XLA_GPU = ROOT / "tests" / "fixtures" / "xla_gpu"


def test_hlo_reader_on_xla_gpus_own_text():
    """The reader's columns on XLA:GPU's own programs, against counts derived by hand: 8 leaves
    (tiny: 4 kernels, 4 biases; 4,856 float32 parameters), each with Adam's two moments.

    Under ``lax.cond`` XLA:GPU keeps the conditional and copies every parameter and moment
    twice: out of the skip branch (24) and, the buffers being donated, out of the conditional
    into the outputs (24): one more read and write of 3 x 4,856 float32 values on every step.
    Under the select formulation: no conditional, no copy, one select per output leaf (24)."""
    cond = gzip.decompress((XLA_GPU / "tiny_post_fused_cond.hlo.txt.gz").read_bytes()).decode()
    select = gzip.decompress((XLA_GPU / "tiny_post_fused_select.hlo.txt.gz").read_bytes()).decode()
    shapes = {"f32[32,64]", "f32[64]", "f32[64,32]", "f32[32]", "f32[32,16]", "f32[16]"}
    shapes |= {"f32[16,8]", "f32[8]"}
    n = 32 * 64 + 64 + 64 * 32 + 32 + 32 * 16 + 16 + 16 * 8 + 8
    assert n == 4856
    c, s = hlo.hlo_stats(cond, shapes), hlo.hlo_stats(select, shapes)
    assert (c["conditionals"], c["param_sized_copies"], c["param_sized_selects"]) == (1, 48, 0)
    assert (s["conditionals"], s["param_sized_copies"], s["param_sized_selects"]) == (0, 0, 24)
    # The conditional's extra pass: the 24 copies after it, read and written (the estimate
    # takes the costlier branch, which is the good one: the skip branch only copies).
    extra = c["bytes_moved"] - s["bytes_moved"]
    assert abs(extra - 2 * 3 * n * 4) < 64, extra
    assert cond.count("true_computation=") == 1 and "branch_computations=" not in cond
    for k in range(8):
        assert hlo.reads(cond, f"grads['{k:03d}']") >= 1 <= hlo.reads(select, f"grads['{k:03d}']")


def test_hlo_reader_reads_one_element_of_a_tuple():
    """``%t#k`` (how jaxlib 0.11 prints a read of a tuple's element, with no
    ``get-tuple-element``) reads element ``k`` alone: a copy of the float32 element of a
    (f32[8], f16[8]) tuple moves 32 + 32 bytes and reads ``a``, not ``b``."""
    text = """ENTRY %main (a: f32[8], b: f16[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0), metadata={op_name="grads['a']"}
  %b = f16[8]{0} parameter(1), metadata={op_name="grads['b']"}
  %t = (f32[8]{0}, /*index=1*/f16[8]{0}) tuple(%a, %b)
  ROOT %c = f32[8]{0} copy(%t#0)
}
"""
    (copy,) = [i for i in hlo.parse_hlo(text)[0]["main"] if i["op"] == "copy"]
    assert (copy["operands"], copy["elements"]) == (["t"], [0])
    assert hlo.bytes_moved(text) == 32 + 32
    assert (hlo.reads(text, "grads['a']"), hlo.reads(text, "grads['b']")) == (1, 0)
    assert hlo.tuple_element("(f32[4,2], (pred[], s32[]), /*index=2*/f16[3])", 1) == (
        "(pred[], s32[])"
    )
    with pytest.raises(ValueError, match="the tuple has 3"):
        hlo.tuple_element("(f32[4,2], (pred[], s32[]), f16[3])", 3)


def test_hlo_reader_on_the_language_models_post_step_on_a_gpu():
    """The Optax path's post step of lm_185m as an H200 ran it (XLA:GPU, jaxlib 0.11.2, the
    skip a select): the entry computation of the optimized module `gpu_check.sh` kept, its
    metadata but the op names and its backend configs taken out. 185,623,552 parameters in 75
    leaves; counts derived by hand:

    - 75 Adam kernels, one per leaf, with the select fused in: each reads the parameter, both
      moments (float32) and the gradient (float16) and writes the three: 26 B/param, what
      plain's post step moves;
    - the overflow check reads each gradient once more: 2 B/param, 28 in all;
    - the check reduces in two levels: the first writes per-leaf partial flags (2 x pred[4096]
      for the embedding, 12 x pred[1024], 13 x pred[1024], 2 x 12 x pred[2048]: 82,944 bytes)
      that the second reads back; the rest is scalars (under 2 KiB).

    The copy of one predicate, ``copy(%tuple.164#78)``, reads one byte: read as the whole
    output tuple (parameters and both moments, 12 B/param) it made the estimate 40 B/param."""
    text = gzip.decompress(
        (XLA_GPU / "lm185m_post_optax_select.entry.hlo.txt.gz").read_bytes()
    ).decode()
    n = workloads.param_count("lm_185m")
    assert n == 185_623_552
    comps, entry = hlo.parse_hlo(text)
    ops = comps[entry]
    kernels = [i["name"].rstrip(".0123456789") for i in ops if i["op"] == "fusion"]
    assert len(kernels) == 99 and kernels.count("loop_add_select_fusion") == 75
    assert kernels.count("input_reduce_fusion") == 12
    (copy,) = [i for i in ops if i["op"] == "copy"]
    assert copy["line"].strip() == "%copy.471 = pred[] copy(%tuple.164#78)"
    shapes = {i["name"]: i["shape"] for i in ops}
    assert hlo._operand_shapes(copy, shapes) == ["pred[]"]
    whole = hlo._shape_bytes(shapes["tuple.164"])
    assert 12 * n < whole < 12 * n + 1024  # what the copy read before: the whole tuple
    stats = hlo.hlo_stats(text, set())
    assert stats["conditionals"] == 0 and stats["kernels"] == 99
    partial_flags = 2 * 4096 + 12 * 1024 + 13 * 1024 + 2 * 12 * 2048
    assert partial_flags == 82_944
    extra = stats["bytes_moved"] - 28 * n - 2 * partial_flags
    assert 0 <= extra < 2048, extra
    assert round(stats["bytes_moved"] / n, 3) == 28.001
    # The embedding's gradient: read by its check and its Adam kernel, nothing else.
    assert hlo.reads(text, "grads['emb']") == 2


def test_compile_for_a_gpu_without_one(tmp_path):
    """``--compile-for h100``: where JAX's CUDA plugin is installed (the GPU machine's JAX), the
    fused step compiled for the described H100 has no conditional and no copy, and the
    conditional forced has both; without it (CI), the error says what to install."""
    deviceless = import_benchmark("deviceless")
    argv = ["--compile-for", "h100", "--cases", "tiny/in_out/fp16grad/post", "--out", str(tmp_path)]
    argv += ["--variants", "lsj_fused_ieee", "lsj_fused_cond_ieee"]
    with pytest.raises(ValueError, match=r"unknown GPU 'a100'; choose from \['h100'\]"):
        cli.main([*argv[:1], "a100", *argv[2:]])
    if not _cuda_plugin():
        with pytest.raises(RuntimeError, match=re.escape(f'pip install "{deviceless.PLUGIN}"')):
            cli.main(argv)
        assert list(tmp_path.iterdir()) == []
        return
    rows = {r["variant"]: r for r in cli.main(argv)}
    assert list(rows) == ["plain", "lsj_fused_ieee", "lsj_fused_cond_ieee"]
    assert (
        rows["lsj_fused_ieee"]["conditionals"] == rows["lsj_fused_ieee"]["param_sized_copies"] == 0
    )
    assert rows["lsj_fused_cond_ieee"]["conditionals"] == 1
    # jaxlib 0.10.2 copies every parameter and moment (8 leaves, 3 arrays each) out of the
    # skip branch and out of the conditional; jaxlib 0.11.2 (the H200 run) copies none.
    assert rows["lsj_fused_cond_ieee"]["param_sized_copies"] in (0, 2 * 3 * 8)
    assert "| lsj_fused_ieee | 0 | 0 |" in (tmp_path / "compiled_h100.md").read_text()


def _cuda_plugin() -> bool:
    """Whether a CUDA plugin of JAX is installed where JAX looks for plugins (a module
    ``xla_cuda*`` of the namespace package ``jax_plugins``: jax-cuda12-plugin, or the CUDA
    13 one a GPU machine's JAX may have); with it, JAX compiles for a described GPU."""
    if importlib.util.find_spec("jax_plugins") is None:
        return False
    import jax_plugins

    return any(m.name.startswith("xla_cuda") for m in pkgutil.iter_modules(jax_plugins.__path__))


@pytest.mark.slow
def test_language_model_workloads():
    """lm_185m is the GPU run's model (185.6M params); lm_tiny is the same code, small; both
    train through the Flax layout only."""
    assert workloads.param_count("lm_185m") == 185_623_552
    spec = workloads.WORKLOADS["lm_tiny"]
    built = workloads.build_case("lm_tiny/in_out/fp16grad/full")
    assert sum(p.size for p in jax.tree_util.tree_leaves(built.params)) == (
        workloads.param_count("lm_tiny")
    )
    tokens, targets = built.args
    assert tokens.shape == targets.shape == (spec["batch"], spec["seq"])
    loss = jax.eval_shape(built.loss, workloads.to16(built.params), tokens, targets)
    assert loss.shape == () and loss.dtype == jnp.float32
    post = workloads.build_case("lm_tiny/in_out/fp16grad/post")
    assert all(g.dtype == jnp.float16 for g in jax.tree_util.tree_leaves(post.args))
    with pytest.raises(ValueError, match="in_out layout only"):
        workloads.check_case("lm_tiny/out_in/fp16grad/full")
    assert set(variants.GPU_VARIANTS.values()) <= set(variants.VARIANTS)
    assert harness.default_modes() == (
        ["latency"] if jax.default_backend() == "cpu" else ["latency", "throughput"]
    )


@pytest.mark.slow
def test_benchmark_throughput_mode():
    """Both modes: one row per variant and mode, each mode's ratios to plain in that mode;
    throughput times ``steps`` back-to-back steps per round, the carry fed through."""
    rows = harness.run_case(
        "tiny/in_out/fp16grad/post",
        ["plain", "lsj_fused_ieee"],
        2,
        1,
        False,
        lambda m: None,
        modes=("latency", "throughput"),
        steps=3,
    )
    assert [(r["mode"], r["variant"]) for r in rows] == [
        ("latency", "plain"),
        ("latency", "lsj_fused_ieee"),
        ("throughput", "plain"),
        ("throughput", "lsj_fused_ieee"),
    ]
    for r in rows:
        assert r["refused"] is None and r["median_ms"] > 0
        assert r["samples"] == (2 if r["mode"] == "latency" else 6)
        if r["variant"] == "plain":
            assert r["ratio"] == r["ratio_lo"] == r["ratio_hi"] == 1.0


@pytest.mark.slow
def test_benchmark_gpu_results_schema(tmp_path, monkeypatch, capsys):
    """`--gpu-results PATH` on CPU with lm_tiny: results_gpu.json has the documented schema
    and its table is written; a variant whose package is missing is skipped with a line; the
    rows carry each step's device time (traced after the rounds; on CPU the busiest host
    track), one measurement for both modes; the traces are not kept."""
    monkeypatch.setattr(variants, "missing_package", lambda name: "jmp" if name == "jmp" else None)
    path = tmp_path / "results_gpu.json"
    argv = ["--gpu-results", str(path), "--rounds", "2", "--iters", "1", "--steps", "2"]
    argv += ["--cases", "lm_tiny/in_out/fp16grad/full", "lm_tiny/in_out/fp16grad/post"]
    argv += ["--variants", "lsj_fused", "lsj_headroom_taps", "jmp", "--modes", *harness.MODES]
    argv += ["--device-steps", "2", "--label", "a rehearsal on CPU"]
    cli.main(argv)
    assert "skipping variant jmp: the package jmp is not installed" in capsys.readouterr().err
    doc = json.loads(path.read_text())
    assert set(doc) == {"meta", "rows"}
    meta = doc["meta"]
    assert set(gpu.GPU_META_KEYS) <= set(meta)
    assert meta["rounds"] == 2 and meta["jax"] == jax.__version__
    assert (meta["label"], meta["device_steps"]) == ("a rehearsal on CPU", 2)
    assert meta["device"].startswith(jax.devices()[0].platform)
    assert any("jmp" in line for line in meta["skipped"]) and meta["refused"] == []
    assert meta["command"].startswith("python benchmarks/bench_step.py --gpu-results")
    rows = doc["rows"]
    assert all(tuple(r) == gpu.GPU_ROW_KEYS for r in rows)
    assert sorted(
        (r["case"].split("/")[-1], r["step"], r["mode"], r["variant"]) for r in rows
    ) == sorted(
        (s, s, m, v)
        for s in ("full", "post")
        for m in harness.MODES
        for v in ("plain", "lsj_fused", "lsj_headroom_taps")
    )
    for r in rows:
        assert r["params"] == workloads.param_count("lm_tiny")
        assert r["ms"] > 0 and r["ratio_lo"] <= r["ratio"] <= r["ratio_hi"]
        if r["variant"] == "plain":
            assert r["ratio"] == 1.0
        assert set(r["variant"]) and r["variant"] in variants.GPU_VARIANTS
        assert r["device_us"] > 0 and r["device_ratio"] > 0
        if r["variant"] == "plain":
            assert r["device_ratio"] == 1.0
    device = {(r["step"], r["variant"], r["mode"]): r["device_us"] for r in rows}
    for s in ("full", "post"):
        for v in ("plain", "lsj_fused", "lsj_headroom_taps"):  # one measurement, both modes
            assert device[s, v, "latency"] == device[s, v, "throughput"]
    assert device["full", "plain", "latency"] != device["post", "plain", "latency"]
    table = path.with_suffix(".md").read_text()
    assert "| lsj_headroom_taps |" in table and "x plain, throughput" in table
    assert "x plain, device" in table and "Measured: a rehearsal on CPU." in table
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results_gpu.json", "results_gpu.md"]
    # --render: the same table from the JSON.
    path.with_suffix(".md").unlink()
    cli.main(["--gpu-results", str(path), "--render"])
    assert path.with_suffix(".md").read_text() == table


def test_device_time_columns_by_hand():
    """``device_columns``: each post row's device time and its ratio to plain's in the same
    case, in every mode; rows of a case not traced get None. The table and the docs' block
    show them."""
    rows = [
        {"case": c, "variant": v, "mode": m}
        for c in ("lm/full", "lm/post")
        for m in ("latency", "throughput")
        for v in ("plain", "lsj_optax_ieee", "where_skip")
    ]
    summaries = {
        "lm/post": {
            "plain": {"us_per_step": 1500.0},
            "lsj_optax_ieee": {"us_per_step": 1620.0},
            "where_skip": {"us_per_step": 1560.0},
        }
    }
    gpu.device_columns(rows, summaries)
    got = {(r["case"], r["variant"], r["mode"]): (r["device_us"], r["device_ratio"]) for r in rows}
    for m in ("latency", "throughput"):
        assert got["lm/post", "plain", m] == (1500.0, 1.0)
        assert got["lm/post", "lsj_optax_ieee", m] == (1620.0, 1620.0 / 1500.0)
        assert got["lm/post", "where_skip", m] == (1560.0, 1.04)
        assert got["lm/full", "lsj_optax_ieee", m] == (None, None)
    for r in rows:
        r.update(kind=r["case"].split("/")[1], params=10**6, median_ms=1.0, refused=None)
        r.update(ratio=1.1, ratio_lo=1.0, ratio_hi=1.2)
    meta = {"device": "gpu: X", "jax": "0", "jaxlib": "0", "optax": "0", "flax": "0"}
    meta.update(command="c", rounds=3, device_steps=20, label="by hand")
    doc = gpu.gpu_results(rows, meta)
    table = gpu.gpu_markdown(doc)
    assert (
        "| where_skip | 1.10 (1.00-1.20) | 1.00 | 1.10 (1.00-1.20) | 1.00 | 1.040 | 1560.0 |"
        in (table)
    )
    block = gpu.gpu_summary(doc)
    row = "| where_skip | " + "1.10 (1.00-1.20) | " * 4 + "1.040 |"
    assert row in block and "| variant | full, latency | full, throughput |" in block
    assert block.startswith("Quoted from `benchmarks/results_gpu.md`: by hand; 3 rounds;")


def test_the_committed_gpu_results_and_the_docs_quote_them(tmp_path):
    """benchmarks/results_gpu.json is a GPU's measurement, labelled with what it measured;
    results_gpu.md and the block of docs/performance.md are what ``--render`` makes of it."""
    saved = json.loads((ROOT / "benchmarks" / "results_gpu.json").read_text())
    meta = saved["meta"]
    assert meta["device"].startswith("gpu: NVIDIA") and meta["label"]
    # The script that measured it and the package's commit (the JAX version is meta["jax"]).
    assert "gpu_check.sh" in meta["label"] and re.search(r" at [0-9a-f]{7,40}\b", meta["label"])
    assert meta["jax"] and meta["device_steps"] > 0
    steps = {(r["step"], r["mode"]) for r in saved["rows"]}
    assert steps == {(s, m) for s in ("full", "post") for m in harness.MODES}
    assert all(r["ratio"] == 1.0 for r in saved["rows"] if r["variant"] == "plain")
    # Every row carries its step's device time (one trace per variant and step, the same in
    # both modes' rows), plain's ratio 1.
    assert all(r["device_us"] > 0 for r in saved["rows"])
    for r in saved["rows"]:
        plain = next(p for p in saved["rows"] if p["variant"] == "plain" and p["step"] == r["step"])
        assert r["device_ratio"] == pytest.approx(r["device_us"] / plain["device_us"], abs=1e-3)
    text = (ROOT / "docs" / "performance.md").read_text()
    assert report.replace_block(text, "gpu_results", gpu.gpu_summary(saved)) == text
    shutil.copy(ROOT / "benchmarks" / "results_gpu.json", tmp_path)
    cli.main(["--gpu-results", str(tmp_path / "results_gpu.json"), "--render"])
    md = (ROOT / "benchmarks" / "results_gpu.md").read_text()
    assert (tmp_path / "results_gpu.md").read_text() == md


def _synthetic_trace(path, step_us):
    """A Perfetto trace as a GPU's reads: a host process, and a device with a line of XLA
    modules and one stream of kernels, each covering the same time."""
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "XLA Modules"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 8, "args": {"name": "Stream #13"}},
        {"ph": "X", "name": "PjitFunction(step)", "pid": 1, "tid": 1, "ts": 0, "dur": 999.0},
    ]
    t = 0.0
    for kernels in step_us:
        events.append(
            {
                "ph": "X",
                "name": "jit_step",
                "pid": 2,
                "tid": 7,
                "ts": t,
                "dur": sum(kernels.values()),
            }
        )
        for name, us in kernels.items():
            events.append({"ph": "X", "name": name, "pid": 2, "tid": 8, "ts": t, "dur": us})
            t += us
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_profile_summary_reads_the_device_tracks(tmp_path):
    """By hand: two steps of 30 + 10 us and 30 + 12 us; the host's event is left out."""
    path = tmp_path / "perfetto_trace.json.gz"
    _synthetic_trace(path, [{"gemm": 30.0, "fusion.1": 10.0}, {"gemm": 30.0, "fusion.1": 12.0}])
    summary = profiling.summarize(path, steps=2)
    assert summary["events"] == "device"
    assert summary["tracks"] == {
        "/device:GPU:0 / XLA Modules": 41.0,
        "/device:GPU:0 / Stream #13": 41.0,
    }
    assert summary["us_per_step"] == 41.0
    stream = {n["name"]: (n["count"], n["us"]) for n in summary["names"] if "Stream" in n["track"]}
    assert stream == {"gemm": (1.0, 30.0), "fusion.1": (1.0, 11.0)}
    # Against a variant with one more kernel and a slower fusion: what it spends beyond plain.
    _synthetic_trace(path, [{"gemm": 30.0, "fusion.1": 13.0, "check": 2.0}])
    mine = profiling.summarize(path, steps=1)["_all_us"]
    assert profiling.more_than(summary["_all_us"], mine) == [
        {"track | name": "/device:GPU:0 / XLA Modules | jit_step", "us": 4.0},
        {"track | name": "/device:GPU:0 / Stream #13 | fusion.1", "us": 2.0},
        {"track | name": "/device:GPU:0 / Stream #13 | check", "us": 2.0},
    ]


@pytest.mark.slow  # about 3 s: two compiles
def test_benchmark_profile_writes_kernels_and_traces(tmp_path):
    """`--profile DIR`: a summary per variant (the device's tracks on an accelerator, the
    host's on CPU, which has no device tracks), what the variant spends beyond plain, and one
    trace per variant; a second run into the same DIR adds its case to kernels.json."""
    out = tmp_path / "profile"
    argv = ["--profile", str(out), "--cases", "tiny/in_out/fp16grad/post", "--steps", "2"]
    rows = cli.main([*argv, "--variants", "plain", "lsj_fused_ieee"])
    assert [r["variant"] for r in rows] == ["plain", "lsj_fused_ieee"]
    assert rows[0]["ratio"] == 1.0 and rows[1]["us_per_step"] > 0
    doc = json.loads((out / "kernels.json").read_text())
    case = doc["cases"]["tiny/in_out/fp16grad/post"]
    events = "host" if jax.default_backend() == "cpu" else "device"
    assert case["plain"]["events"] == events and "more_than_plain" not in case["plain"]
    assert all(m["us"] > 0 for m in case["lsj_fused_ieee"]["more_than_plain"])
    traces = sorted(p.parent.parent.parent.parent.name for p in out.rglob("perfetto_trace*"))
    assert traces == [f"tiny_in_out_fp16grad_post.{v}" for v in ("lsj_fused_ieee", "plain")]
    argv = ["--profile", str(out), "--cases", "tiny/in_out/fp16grad/full", "--steps", "1"]
    cli.main([*argv, "--variants", "plain", "where_skip"])
    doc = json.loads((out / "kernels.json").read_text())
    assert doc["steps"] == {"tiny/in_out/fp16grad/post": 2, "tiny/in_out/fp16grad/full": 1}
    assert doc["cases"]["tiny/in_out/fp16grad/post"] == case
    assert list(doc["cases"]["tiny/in_out/fp16grad/full"]) == ["plain", "where_skip"]


def test_underflow_counts_the_entries_the_unscaled_backward_pass_loses(tmp_path):
    """``--underflow``: entries zero in the plain step's float16 gradient and not in the scaled
    one, on a loss whose gradient is known: ``sum(p * c)``, so the float16 gradient is ``c``
    (times the scale) rounded to float16. 1e-8 is below half float16's smallest subnormal
    (2^-24 / 2): zero unscaled, 4.1e-5 scaled by 2^12; 1e-3 survives both, 0 is zero in both."""
    underflow = import_benchmark("underflow")
    c = np.array([1e-8, 1e-8, 1e-8, 1e-3, 1e-3, 0.0], np.float32)

    def loss(p16, x, y):
        return jnp.sum(p16["a"].astype(jnp.float32) * c)

    params = {"a": jnp.ones(6, jnp.float32)}
    case = workloads.Case("t", "in_out", "fp16grad", "full", params, loss, (None, None))
    got = underflow.lost_entries(case)
    assert (got["size"], got["lost"], got["fraction"]) == (6, 3, 0.5)
    assert got["leaves"] == [
        {"leaf": "['a']", "size": 6, "lost": 3, "zero_plain": 4, "zero_scaled": 1}
    ]
    with pytest.raises(ValueError, match="full step"):
        underflow.lost_entries(case._replace(kind="post"))
    rows = cli.main(["--underflow", "--cases", "tiny/in_out/fp16grad/full", "--out", str(tmp_path)])
    assert rows[0]["size"] == workloads.param_count("tiny") == 4856
    assert json.loads((tmp_path / "underflow.json").read_text())["rows"] == rows


def test_the_committed_h100_program_is_the_select_and_the_docs_quote_it(tmp_path):
    """benchmarks/compiled_h100.json (``--compile-for h100``, from a process without a GPU):
    the library's steps as XLA:GPU compiles them have no conditional and no parameter-sized
    copy, and the optimizer step moves one more read of the float16 gradients than plain's
    (2 bytes per parameter over plain's 26: 1.077x), the select fused into the optimizer's
    kernels (fenced, as the CPU's select is, it moved 2.31x); the conditional forced is one,
    which jaxlib 0.10.2 made copy every parameter and both moments twice (2 x 3 per leaf, 75
    leaves) and jaxlib 0.11 and newer do not; the docs' block and compiled_h100.md are what
    ``--render`` makes of it."""
    saved = json.loads((ROOT / "benchmarks" / "compiled_h100.json").read_text())
    rows = {(r["case"].split("/")[-1], r["variant"]): r for r in saved["rows"]}
    for step in ("full", "post"):
        for name in ("lsj_optax_ieee", "lsj_fused_ieee", "lsj_headroom_taps"):
            r = rows[(step, name)]
            assert r["conditionals"] == r["param_sized_copies"] == 0, r
        forced = rows[(step, "lsj_fused_cond_ieee")]
        assert forced["conditionals"] == 1 and forced["param_sized_copies"] in (0, 2 * 3 * 75)
    plain = rows[("post", "plain")]["bytes_moved"]
    for name in ("lsj_optax_ieee", "lsj_fused_ieee"):
        assert rows[("post", name)]["bytes_moved"] <= 1.08 * plain, name
    summary = import_benchmark("deviceless").summary
    text = (ROOT / "docs" / "performance.md").read_text()
    block = summary(saved["rows"], "h100", saved["meta"]["jax"])
    assert report.replace_block(text, "compiled_h100", block) == text
    shutil.copy(ROOT / "benchmarks" / "compiled_h100.json", tmp_path)
    cli.main(["--compile-for", "h100", "--render", "--out", str(tmp_path)])
    md = (ROOT / "benchmarks" / "compiled_h100.md").read_text()
    assert (tmp_path / "compiled_h100.md").read_text() == md


@pytest.mark.slow
def test_underflow_of_the_logits_gradient_against_numpy(monkeypatch):
    """``logits_lost`` on a language model whose logits' gradient underflows as the 185M one's
    does (vocabulary 32768, 8 x 256 tokens: ``(softmax - onehot) / 2048`` per logit, about
    1.5e-8 where the softmax is near uniform, below half float16's smallest subnormal),
    against the same gradient in NumPy: the softmax of the model's float16 logits, rounded to
    float32, then float16."""
    underflow = import_benchmark("underflow")
    spec = {"kind": "lm", "vocab": 32768, "d": 32, "layers": 1, "heads": 2, "seq": 256, "batch": 8}
    monkeypatch.setitem(workloads.WORKLOADS, "lm_wide", spec)
    case = workloads.build_case("lm_wide/in_out/fp16grad/full")
    got = underflow.logits_lost(case)
    tokens, targets = case.args
    logits = np.asarray(workloads.make_lm_forward(spec)(workloads.to16(case.params), tokens[:1]))
    z = logits.astype(np.float64)[0]
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    p[np.arange(256), np.asarray(targets[0])] -= 1.0
    zero = np.sum((p / (8 * 256)).astype(np.float32).astype(np.float16) == 0)
    assert got["size"] == 256 * 32768 and got["zero_scaled"] == 0
    assert got["zero_plain"] > 0.99 * got["size"]  # all but the targets and a few large ones
    assert abs(got["zero_plain"] - zero) <= 1e-5 * got["size"], (got, zero)  # rounding ties
    with pytest.raises(ValueError, match="language model's full step"):
        underflow.logits_lost(workloads.build_case("tiny/in_out/fp16grad/full"))


@pytest.mark.slow
def test_first_call_benchmark_counts_the_traces_python_calls():
    """``bench_first_call.py --calls``: the tiny model's loss-scaled steps make more Python
    calls while traced than plain's. In one process (the benchmark runs each in a fresh one)
    the first trace also pays for what JAX sets up once, so plain is traced once before."""
    bench = load_script("benchmarks/bench_first_call.py")
    bench.trace_calls("plain", "tiny")
    plain, optax_path, fused = (bench.trace_calls(v, "tiny") for v in ("plain", "optax", "fused"))
    assert 0 < plain < min(optax_path, fused), (plain, optax_path, fused)


@cpu_hlo
@pytest.mark.slow
def test_first_call_benchmark_counts_the_kernels_xla_cpu_compiles():
    """``bench_first_call.py --kernels``: each scalar a function returns apart is a kernel of
    its own on XLA:CPU, so n more such results are n more kernels (derived by hand, whatever
    the fixed count); and the tiny model's loss-scaled steps compile more than plain's, the
    fused step no more than the Optax path (whose updates cross the conditional)."""
    bench = load_script("benchmarks/bench_first_call.py")

    def scalars(n, wrap=lambda outs: outs):
        def f(x, flag):
            return wrap(tuple(jnp.where(flag, x * (i + 2.0) + i, x - 3.0 * i) for i in range(n)))

        jax.clear_caches()
        return bench.compiled_kernels(jax.jit(f).lower(jnp.float32(3), jnp.bool_(True)))

    one = scalars(1)  # once: compiled again in this process, it recorded no kernel event
    assert scalars(6) - one == 5
    # the same six through engine/_platform.one_kernel_on_cpu: one kernel
    assert scalars(6, one_kernel_on_cpu) == one
    plain, optax_path, fused = (bench.kernels(v, "tiny") for v in ("plain", "optax", "fused"))
    assert plain < fused <= optax_path, (plain, fused, optax_path)


@pytest.mark.slow
def test_first_call_benchmark_reports_each_stage_against_plain(tmp_path):
    """`benchmarks/bench_first_call.py` at its smoke size, the command run as a process: a row
    per step, plain's ratios exactly 1, and each first call the sum of its stages (one round:
    the medians are the round's own figures). Nothing here is timed against a bar."""
    out = tmp_path / "first_call.json"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_first_call.py")]
    subprocess.run(
        [*command, "--models", "tiny", "--rounds", "1", "--json", str(out)],
        check=True,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["variant"]) for r in rows] == [
        ("tiny", "plain"),
        ("tiny", "optax"),
        ("tiny", "fused"),
    ]
    stages = ("trace", "lower", "compile", "run")
    for row in rows:
        for clock in ("", "_cpu"):
            assert all(row[f"{s}{clock}_s"] > 0 for s in stages)
            total = sum(row[f"{s}{clock}_s"] for s in stages)
            assert row[f"first_call{clock}_s"] == pytest.approx(total)
            if row["variant"] == "plain":
                assert all(row[f"{s}{clock}_x"] == 1.0 for s in (*stages, "first_call"))
