"""jmp's own loss-scale tests, run against ``lossscale_jax.compat.jmp``.

Upstream: ``jmp/_src/loss_scale_test.py`` (jmp 0.0.4, class ``LossScaleTest``). Every test below
names the upstream test it ports and keeps upstream's arguments and expected numbers; a
``jmp.DynamicLossScale(...)``/``.adjust(grads_finite)`` becomes
``compat.jmp.dynamic_loss_scale_policy(...)``/``policy.adjust(state, not grads_finite)``, and
jmp's ``loss_scale``/``counter`` fields are the state's ``scale``/``growth_count``. Where this
library differs on purpose the test asserts the documented behaviour (docs/porting.md, "The
peers' own tests").
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_policy  # noqa: I001  (tests/ is on sys.path under pytest)

import lossscale_jax as lsj
from lossscale_jax import compat


def test_no_op_loss_scale():
    # Upstream: test_no_op_loss_scale (scale/unscale return the tree itself).
    state = compat.jmp.no_op_loss_scale_policy().init()
    tree = {"a": jnp.ones([])}
    assert float(lsj.scale_loss(tree["a"], state)) == 1.0
    np.testing.assert_array_equal(lsj.unscale(tree, state.scale)["a"], tree["a"])


@pytest.mark.parametrize(
    "cls, scale",
    [
        (compat.jmp.static_loss_scale_policy, 2),
        (compat.jmp.static_loss_scale_policy, 3),
        (compat.jmp.static_loss_scale_policy, 4),
        (compat.jmp.dynamic_loss_scale_policy, 2.0),
        (compat.jmp.dynamic_loss_scale_policy, 3.0),
        (compat.jmp.dynamic_loss_scale_policy, 4.0),
    ],
)
def test_static_loss_scale(cls, scale):
    # Upstream: test_static_loss_scale (StaticLossScale(2) ... DynamicLossScale(4)).
    state = cls(scale).init()
    tree = {"a": jnp.array(1.0)}
    scaled = {"a": jnp.array(1.0 * scale)}
    assert float(lsj.scale_loss(tree["a"], state)) == float(scaled["a"])
    assert float(lsj.unscale(scaled, state.scale)["a"]) == float(tree["a"])


def test_static_empty_trees():
    # Upstream: test_static_empty_trees (NoOpLossScale, StaticLossScale(0) have no pytree leaves).
    # The drop-in objects pass as written: as in jmp, the object is its treedef's static data.
    for loss_scale in (compat.jmp.NoOpLossScale(), compat.jmp.StaticLossScale(0)):
        assert jax.tree_util.tree_leaves(loss_scale) == []
    # Documented deviation of the policies: a static scale lives in the policy's state as a
    # traced float32 (a new value does not recompile), so the state has leaves; and a scale of
    # 0, which would zero every gradient, is rejected.
    assert jax.tree_util.tree_leaves(compat.jmp.no_op_loss_scale_policy().init())
    assert jax.tree_util.tree_leaves(compat.jmp.static_loss_scale_policy(4).init())
    with pytest.raises(ValueError, match="loss_scale must be a finite number > 0"):
        compat.jmp.static_loss_scale_policy(0)


def test_dynamic_loss_scale_no_warnings():
    # Upstream: test_dynamic_loss_scale_no_warnings.
    with warnings.catch_warnings(record=True) as logged:
        warnings.simplefilter("always")
        compat.jmp.dynamic_loss_scale_policy(2.0**15)
    assert logged == []


def test_dynamic_loss_scale_tree():
    # Upstream: test_dynamic_loss_scale_tree: the scale and the counter are the pytree's leaves
    # and tree_map(identity) gives an equal object. Here they are leaves of the state, beside
    # its telemetry counters.
    scale = jnp.ones([])
    counter = jnp.zeros([], jnp.int32)
    period = 2000
    factor = 2
    state = compat.jmp.dynamic_loss_scale_policy(scale, counter, period, factor).init()
    assert float(state.scale) == float(scale) and int(state.growth_count) == int(counter)
    leaves = jax.tree_util.tree_leaves(state)
    assert any(leaf is state.scale for leaf in leaves)
    assert any(leaf is state.growth_count for leaf in leaves)
    same = jax.tree_util.tree_map(lambda x: x, state)
    assert jax.tree_util.tree_structure(same) == jax.tree_util.tree_structure(state)
    for a, b in zip(jax.tree_util.tree_leaves(same), leaves, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("period, factor", [(20, 2), (30, 3)])
def test_dynamic_loss_scale_adjust_increases_on_finite(period, factor):
    # Upstream: test_dynamic_loss_scale_adjust_increases_on_finite.
    policy = compat.jmp.dynamic_loss_scale_policy(jnp.float32(10), jnp.int32(0), period, factor)
    assert policy.growth_interval == period and policy.growth_factor == factor
    steps = run_policy(policy, [False] * period)
    for i in range(1, period):
        assert steps.scale[i - 1] == 10
        assert steps.growth_count[i - 1] == i
    # Loss scale should wrap.
    assert steps.scale[-1] == 10 * factor
    assert steps.growth_count[-1] == 0


# Upstream's own expressions (a float32 divided by 3**100) overflow NumPy's cast; as upstream.
_CAST = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")


@_CAST
@pytest.mark.parametrize("period, factor", [(20, 2), (30, 3)])
def test_dynamic_loss_scale_adjust_reduce_on_non_finite(period, factor):
    # Upstream: test_dynamic_loss_scale_adjust_reduce_on_non_finite.
    init = np.float32(10)
    policy = compat.jmp.dynamic_loss_scale_policy(jnp.asarray(init), jnp.int32(0), period, factor)
    assert init / (factor**100) < 1  # should cover max(1, S)
    steps = run_policy(policy, [True] * 100)
    for i in range(100):
        np.testing.assert_allclose(steps.scale[i], max(1, init / (factor ** (i + 1))), rtol=1e-5)
        assert steps.growth_count[i] == 0


@_CAST
@pytest.mark.parametrize(
    "period, factor, min_loss_scale", [(20, 2, 0.3125), (30, 3, 0.37), (5.0, 2.0, 0.0)]
)
def test_dynamic_loss_scale_explicit_min_loss_scale(period, factor, min_loss_scale):
    # Upstream: test_dynamic_loss_scale_explicit_min_loss_scale (period=5. and min_loss_scale=0.
    # included: jmp accepts a whole float period and no floor).
    init = np.float32(10)
    policy = compat.jmp.dynamic_loss_scale_policy(
        jnp.asarray(init), jnp.int32(0), period, factor, jnp.asarray(min_loss_scale)
    )
    assert init / (factor**100) < 1  # should cover max(1, S)
    steps = run_policy(policy, [True] * 100)
    for i in range(100):
        np.testing.assert_allclose(
            steps.scale[i], max(min_loss_scale, init / (factor ** (i + 1))), rtol=1e-5
        )
        assert steps.growth_count[i] == 0
    assert policy.growth_interval == period and policy.growth_factor == factor


def test_dynamic_loss_scale_adjust_requires_scalar_input():
    # Upstream: test_dynamic_loss_scale_adjust_requires_scalar_input (its body is empty); the
    # requirement its name states holds here.
    policy = compat.jmp.dynamic_loss_scale_policy(jnp.float32(10))
    with pytest.raises(ValueError, match="overflow must be a scalar"):
        policy.adjust(policy.init(), jnp.array([True, False]))


def test_dynamic_loss_scale_raises_type_error_on_int_loss_scale():
    # Upstream: test_dynamic_loss_scale_raises_type_error_on_int_loss_scale (jmp warns
    # "Expected floating type for loss_scale"). Documented deviation: the state's scale is
    # always float32, so an integer scale is converted exactly and nothing is warned.
    with warnings.catch_warnings(record=True) as logged:
        warnings.simplefilter("always")
        state = compat.jmp.dynamic_loss_scale_policy(jnp.asarray(1, dtype=jnp.int32)).init()
    assert logged == [] and state.scale.dtype == jnp.float32 and float(state.scale) == 1.0


def test_dynamic_loss_scale_raises_type_error_on_int_min_loss_scale():
    # Upstream: test_dynamic_loss_scale_raises_type_error_on_int_min_loss_scale (jmp warns).
    # Documented deviation, as above: min_loss_scale is a float32 hyperparameter here.
    with warnings.catch_warnings(record=True) as logged:
        warnings.simplefilter("always")
        policy = compat.jmp.dynamic_loss_scale_policy(
            jnp.asarray(1, dtype=jnp.float32), min_loss_scale=jnp.asarray(1, dtype=jnp.int32)
        )
    assert logged == [] and policy.min_scale == 1.0


@pytest.mark.parametrize("non_finite", [jnp.inf, jnp.nan])
def test_all_finite(non_finite):
    # Upstream: test_all_finite (jmp.all_finite is `not lsj.check_overflow`).
    def all_finite(tree):
        return not bool(lsj.check_overflow(tree))

    assert all_finite(None)
    assert all_finite({})
    assert not all_finite({"a": jnp.array(non_finite)})
    assert not all_finite({"a": jnp.ones([]), "b": jnp.array(non_finite)})
    assert not all_finite({"a": jnp.array(non_finite), "b": jnp.ones([])})
    assert all_finite({"a": jnp.ones([]), "b": jnp.ones([])})


def test_select_tree():
    # Upstream: test_select_tree (compat.jmp.select_tree is jmp's, one select per leaf).
    a = {"a": jnp.ones([]), "b": jnp.zeros([])}
    b = {"a": jnp.zeros([]), "b": jnp.ones([])}
    assert compat.jmp.select_tree(jnp.bool_(True), None, None) is None
    assert compat.jmp.select_tree(jnp.bool_(False), None, None) is None
    assert compat.jmp.select_tree(jnp.bool_(True), a, b) == a
    assert compat.jmp.select_tree(jnp.bool_(False), a, b) == b


def test_select_tree_rejects_non_scalar():
    # Upstream: test_select_tree_rejects_non_scalar (jmp asserts: AssertionError "expected
    # boolean scalar"). Documented deviation: a ValueError that names the argument.
    with pytest.raises(ValueError, match="pred must be a boolean scalar"):
        compat.jmp.select_tree(jnp.ones([1]), None, None)
