"""``engine._ops``: ``where`` and ``isinf`` are ``jnp.where`` and ``jnp.isinf`` (the reference:
JAX's own functions), value and type, eagerly and under jit, vmap, grad and shard_map, with no
nested jit where their one primitive does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lossscale_jax.engine._ops import isinf, where

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
SPECIALS = [0.0, -0.0, 1.5, -2.0, np.inf, -np.inf, np.nan, 6e-8, 65504.0]

CASES = {
    "scalar condition": (jnp.bool_(True), jnp.ones(3, F16), jnp.zeros(3, F16)),
    "condition of their shape": (
        jnp.array([True, False, True]),
        jnp.asarray(SPECIALS[:3], F32),
        jnp.asarray(SPECIALS[4:7], F32),
    ),
    "weak scalars": (jnp.bool_(False), jnp.asarray(1.0), jnp.asarray(2.0)),
    "int32 counters": (jnp.bool_(True), jnp.int32(7), jnp.int32(2**31 - 1)),
    "weak beside strong": (jnp.bool_(False), jnp.asarray(1.0), F32(2)),
    "a Python number": (jnp.bool_(False), 1.0, BF16(2)),
    "dtypes to promote": (jnp.bool_(True), jnp.int32(3), F32(2)),
    "condition to broadcast": (jnp.array([True, False]), jnp.ones((3, 2)), jnp.zeros((3, 2))),
    "a Python condition": (True, jnp.ones(2), jnp.zeros(2)),
    "an integer condition": (jnp.int32(0), jnp.ones(2), jnp.zeros(2)),
}
FAST = {
    "scalar condition",
    "condition of their shape",
    "weak scalars",
    "int32 counters",
}


def same(a, b):
    assert jax.typeof(a) == jax.typeof(b)
    np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))


@pytest.mark.parametrize("name", CASES)
def test_where_is_jnp_where_eagerly_and_under_jit(name):
    c, x, y = CASES[name]
    same(where(c, x, y), jnp.where(c, x, y))
    static = tuple(i for i, v in enumerate(CASES[name]) if isinstance(v, (bool, float)))
    mine, theirs = jax.jit(lambda *a: (where(*a), jnp.where(*a)), static_argnums=static)(c, x, y)
    same(mine, theirs)


@pytest.mark.parametrize("name", CASES)
def test_where_binds_one_select_where_that_is_all_jnp_where_does(name):
    c, x, y = CASES[name]
    static = tuple(i for i, v in enumerate(CASES[name]) if isinstance(v, (bool, float)))
    jaxpr = jax.make_jaxpr(where, static_argnums=static)(c, x, y)
    prims = [e.primitive.name for e in jaxpr.eqns]
    if name in FAST:
        # What jnp.where binds inside its jit (the condition broadcast to the operands' shape,
        # the select), without the jit: the program it gives.
        (call,) = jax.make_jaxpr(jnp.where, static_argnums=static)(c, x, y).eqns
        inner = call.params["jaxpr"].eqns
        assert prims == [e.primitive.name for e in inner] and "jit" not in prims
        assert "select_n" in prims
    else:  # jax.numpy's own call, its jit and all
        assert str(jaxpr) == str(jax.make_jaxpr(jnp.where, static_argnums=static)(c, x, y))


def test_where_under_vmap_and_grad_is_jnp_where():
    p = jnp.array([True, False])
    xs = jnp.arange(6.0).reshape(2, 3)
    same(jax.vmap(lambda p, x: where(p, x, -x))(p, xs), jax.vmap(jnp.where)(p, xs, -xs))
    x = jnp.asarray([0.5, 2.0, np.inf])
    mine = jax.grad(lambda x: where(x > 1, x * x, 3 * x).sum())(x)
    theirs = jax.grad(lambda x: jnp.where(x > 1, x * x, 3 * x).sum())(x)
    same(mine, theirs)


def test_where_under_shard_map_is_jnp_where_varying_or_not():
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])

    def body(x, p):
        s = jnp.sum(x) > 2  # varies over the axis
        u = jnp.ones(1)  # does not
        mine = (where(s, x, -x), where(p, x, 2 * x), where(s, u, 2 * u), where(p, u, 2 * u))
        theirs = (
            jnp.where(s, x, -x),
            jnp.where(p, x, 2 * x),
            jnp.where(s, u, 2 * u),
            jnp.where(p, u, 2 * u),
        )
        return mine, theirs

    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))
    specs = (P("d"),) * 4
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()), out_specs=(specs, specs))
    mine, theirs = jax.jit(mapped)(x, jnp.bool_(True))
    for a, b in zip(mine, theirs, strict=True):
        same(a, b)


@pytest.mark.parametrize("dtype", [F16, BF16, F32, jnp.int32, jnp.bool_])
def test_isinf_is_jnp_isinf(dtype):
    values = SPECIALS if jnp.issubdtype(dtype, jnp.floating) else [0, 1, 0]
    x = jnp.asarray(values).astype(dtype)
    same(isinf(x), jnp.isinf(x))
    same(jax.jit(isinf)(x), jnp.isinf(x))
    prims = [e.primitive.name for e in jax.make_jaxpr(isinf)(x).eqns]
    if jnp.issubdtype(dtype, jnp.floating):
        assert prims == ["abs", "eq"]
