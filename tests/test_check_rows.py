"""The overflow check in rows (``engine/_check_rows.py``, what a step lowered for a GPU runs)
gives the grouped check's flags (XLA:CPU's, ``_check.leaf_flags``), leaf for leaf.

Run here on the CPU, called directly: leaves of assorted shapes and sizes (one element, a row's
width, a row and one more, several rows, empty, a scalar), of float16, bfloat16 and float32,
with an overflowing value placed in the first, the last, a padded row's last real element and
random positions, in every mode, against the grouped check and a NumPy reference of the rule
(``_check.predicates``'s, written out). And where the step goes: lowered for ``cuda`` the check
is the row reduction (a ``reduce`` over ``[rows, ROW]``), lowered for the CPU the grouped one.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lossscale_jax.engine import _check, _check_rows, _platform

ROW = _check_rows.ROW
SHAPES = [(), (1,), (ROW,), (ROW + 1,), (3, ROW // 2 + 5), (2, 3, 7), (0,), (64, 48), (64, 48)]
DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32]


def by_hand(leaves, mode, threshold):
    """The rule, in NumPy: ieee, inf or nan; saturating, |g| >= threshold and not nan; both,
    |g| >= threshold or nan (the threshold rounded to the leaf's dtype)."""
    out = []
    for g in leaves:
        x = np.asarray(g).astype(np.float64)
        limit = float(np.asarray(threshold).astype(np.asarray(g).dtype))
        if mode == "ieee":
            hit = np.isinf(x) | np.isnan(x)
        elif mode == "saturating":
            hit = np.abs(x) >= limit  # nan compares False
        else:
            hit = (np.abs(x) >= limit) | np.isnan(x)
        out.append(bool(hit.any()))
    return out


def leaves_with(rng, bad, where):
    leaves = []
    for k, shape in enumerate(SHAPES):
        dtype = DTYPES[k % len(DTYPES)]
        x = rng.normal(0.0, 1.0, shape).astype(dtype)
        n = x.size
        if n and (k % 3 == where % 3):
            flat = x.reshape(-1)
            position = {0: 0, 1: n - 1, 2: int(rng.integers(n))}[where % 3]
            with np.errstate(over="ignore"):  # -70000 is -inf in float16, as a device writes it
                flat[position] = bad
        leaves.append(jnp.asarray(x))
    return leaves


@pytest.mark.parametrize("mode", _check.OVERFLOW_MODES)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan, 65504.0, -70000.0, 1.0])
@pytest.mark.parametrize("where", range(6))
def test_rows_give_the_grouped_flags(mode, bad, where):
    rng = np.random.default_rng(where)
    leaves = leaves_with(rng, bad, where)
    threshold = _check.threshold(jnp.float16)
    rows = np.asarray(jax.jit(lambda ls: _check_rows.in_rows(ls, mode, threshold))(leaves))
    grouped = np.asarray(jax.jit(lambda ls: _check_rows.grouped(ls, mode, threshold))(leaves))
    assert rows.tolist() == grouped.tolist() == by_hand(leaves, mode, threshold)
    if np.isinf(bad):
        assert rows.any()  # an overflow in every mode: the comparison saw one


def test_an_overflow_in_each_leaf_alone():
    # One leaf at a time holds the inf: its flag alone is set, at whatever row it sits.
    shapes = [(5,), (ROW + 3,), (2, ROW), (7, 9), (1,)]
    clean = [jnp.zeros(s, jnp.float16) for s in shapes]
    threshold = _check.threshold(jnp.float16)
    for i, s in enumerate(shapes):
        for position in (0, int(np.prod(s)) - 1):
            leaves = list(clean)
            leaves[i] = leaves[i].reshape(-1).at[position].set(jnp.inf).reshape(s)
            flags = _check_rows.in_rows(leaves, "ieee", threshold)
            assert np.asarray(flags).tolist() == [j == i for j in range(len(shapes))]


def test_leaves_without_rows():
    threshold = _check.threshold(jnp.float16)
    assert _check_rows.in_rows([], "ieee", threshold).shape == (0,)
    empty = [jnp.zeros((0,), jnp.float32), jnp.zeros((0, 3), jnp.float16)]
    assert np.asarray(_check_rows.in_rows(empty, "ieee", threshold)).tolist() == [False, False]


def test_the_platform_lowered_for_picks_the_check():
    # Each formulation is traced where it is kept, when lowered: XLA:CPU's program has the
    # grouped reductions alone (no row of ROW elements), and computes the same flags.
    grads = {"a": jnp.ones((64, 48), jnp.float16), "b": jnp.ones((ROW + 1,), jnp.float16)}

    def check(g):
        return _check_rows.leaf_vector(g, "ieee", jnp.float16)

    traced = jax.jit(check).trace(grads)
    rows = f"{(64 * 48 + ROW - 1) // ROW + 2}x{ROW}xi1>"  # the rows, concatenated
    assert rows in traced.lower(lowering_platforms=("cuda",)).as_text()
    compiled = traced.lower(lowering_platforms=("cpu",)).compile().as_text()
    assert f",{ROW}]" not in compiled and "reduce(" in compiled
    assert np.asarray(jax.jit(check)(grads)).tolist() == [False, False]
    bad = {"a": grads["a"].at[3, 4].set(jnp.nan), "b": grads["b"]}
    assert np.asarray(check(bad)).tolist() == [True, False]


def _returned(text: str) -> str:
    """The op that defines the value ``main`` returns, in StableHLO text."""
    (value,) = re.findall(r"^\s*(?:func\.)?return (%[\w#]+) :", text, re.M)[:1]
    (op,) = re.findall(rf"^\s*{re.escape(value)} = (?:\"?)([\w.]+)", text, re.M)
    return op


@pytest.mark.parametrize("platform", ["cpu", "cuda", "rocm", "tpu"])
def test_pick_returns_the_value_of_the_platform_lowered_for(platform):
    def f(x):
        return _platform.pick(x + 1.0, x * 2.0, ("cuda", "rocm"))

    text = jax.jit(f).trace(jnp.ones(3)).lower(lowering_platforms=(platform,)).as_text()
    want = "stablehlo.multiply" if platform in ("cuda", "rocm") else "stablehlo.add"
    assert _returned(text) == want and "stablehlo.case" not in text
    assert np.asarray(f(jnp.ones(3))).tolist() == [2.0, 2.0, 2.0]  # eagerly: the default
    assert np.asarray(jax.jit(f)(jnp.ones(3))).tolist() == [2.0, 2.0, 2.0]  # the CPU's: x + 1
    batched = jax.vmap(f)(jnp.ones((2, 3)))
    assert batched.shape == (2, 3) and np.asarray(batched).tolist() == [[2.0] * 3] * 2
    with pytest.raises(ValueError, match="one shape and dtype"):
        _platform.pick(jnp.ones(3), jnp.ones(2), ("cuda",))


def _counted():
    calls = {"default": 0, "on": 0}

    def default(x, y):
        calls["default"] += 1
        return x + y

    def on(x, y):
        calls["on"] += 1
        return x * y

    return calls, default, on


@pytest.mark.parametrize("platform", ["cpu", "cuda", "rocm", "tpu"])
def test_pick_when_lowered_traces_the_kept_function_alone_and_only_when_lowered(platform):
    calls, default, on = _counted()
    out = jax.ShapeDtypeStruct((3,), jnp.float32)

    def f(x, y):
        return _platform.pick_when_lowered(default, on, ("cuda", "rocm"), [x, y], out) - 1.0

    x, y = jnp.full(3, 3.0), jnp.full(3, 5.0)
    traced = jax.jit(f).trace(x, y)
    assert calls == {"default": 0, "on": 0}  # the trace holds neither
    assert "pick_when_lowered" in str(traced.jaxpr)
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    gpu = platform in ("cuda", "rocm")
    assert calls == ({"default": 0, "on": 1} if gpu else {"default": 1, "on": 0})
    assert ("stablehlo.multiply" in text) == gpu and ("stablehlo.add" in text) != gpu
    assert "stablehlo.case" not in text
    assert np.asarray(jax.jit(f)(x, y)).tolist() == [7.0] * 3  # this process's CPU: x + y - 1
    assert np.asarray(f(x, y)).tolist() == [7.0] * 3  # eagerly: the default's


def test_pick_when_lowered_for_several_platforms_switches_on_the_platform():
    calls, default, on = _counted()
    out = jax.ShapeDtypeStruct((3,), jnp.float32)

    def f(x, y):
        return _platform.pick_when_lowered(default, on, ("cuda",), [x, y], out)

    x = jnp.full(3, 2.0)
    text = jax.jit(f).trace(x, x).lower(lowering_platforms=("cpu", "cuda")).as_text()
    assert calls == {"default": 1, "on": 1} and "stablehlo.case" in text


def test_pick_when_lowered_under_vmap_grad_and_shard_map_is_pick():
    _, default, on = _counted()
    out = jax.ShapeDtypeStruct((3,), jnp.float32)

    def lazy(x, y):
        return _platform.pick_when_lowered(default, on, ("cuda",), [x, y], out)

    def eager(x, y):
        return _platform.pick(default(x, y), on(x, y), ("cuda",))

    xs, ys = jnp.arange(6.0).reshape(2, 3), jnp.full((2, 3), 0.5)
    for fn in (jax.vmap(lazy), jax.jit(jax.vmap(lazy))):
        np.testing.assert_array_equal(fn(xs, ys), xs + ys)
    batched = jax.jit(jax.vmap(lazy, in_axes=(0, None))).trace(xs, ys[0])
    text = batched.lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.multiply" in text and "stablehlo.add" not in text

    def loss(f):
        return lambda x: jnp.sum(f(x, x * x) ** 2)

    for x in (jnp.arange(3.0), -jnp.arange(3.0) / 7):
        mine, theirs = jax.jit(jax.grad(loss(lazy)))(x), jax.jit(jax.grad(loss(eager)))(x)
        np.testing.assert_array_equal(mine, theirs)
        np.testing.assert_allclose(mine, 2 * (x + x * x) * (1 + 2 * x), rtol=1e-6)

    # Under a mesh the type of a result says what varies over its axes: both are traced.
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
    mapped = jax.shard_map(
        lambda x, y: lazy(x, y) - 1.0,
        mesh=mesh,
        in_specs=(P("d"), P()),
        out_specs=P("d"),
    )
    x = jax.device_put(jnp.arange(12.0), NamedSharding(mesh, P("d")))
    got = jax.jit(mapped)(x, jnp.ones(3))
    np.testing.assert_array_equal(got, jnp.arange(12.0))
