"""``lossscale_jax.compat.jmp`` in place of ``jmp``: a jmp program runs unchanged, bit for bit.

The program is jmp's documented loop (README, ``DynamicLossScale`` docstring): a policy from
``get_policy``, the loss scaled, the gradients unscaled, ``all_finite``, ``adjust`` and
``select_tree``, here with an Adam step on a small float16 MLP and overflows injected. It
runs once with the real ``jmp`` module and once with ``compat.jmp``, for each kind of loss
scale; every step's parameters, Adam state, loss scale, counter and finite flag must be
bit-identical.

Bit equality, not a tolerance: float16 and float32 arithmetic on XLA:CPU can round
differently from host to host (AVX-512 FP16 hardware, for one), but both runs here are on one
host and, once the drop-in computes what jmp computes (the same operations, the same
constants folded by XLA), they are the same program, so every bit must agree. A lax.cond in
``select_tree`` or a traced static scale changed Adam's last bit within a few steps; SGD alone
did not show it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import jmp as real_jmp
import numpy as np
import optax
import pytest
from helpers import assert_bits_equal  # noqa: I001  (tests/ is on sys.path under pytest)

from lossscale_jax.compat import jmp as our_jmp

STEPS = 24
# Poisoned batches: inf and nan reach every kind's gradients; 3e4 overflows only under a
# large scale. The scales below also overflow the float16 backward pass on their own.
OVERFLOW = {2: np.inf, 5: 3.0e4, 6: np.nan, 11: np.inf, 17: np.inf}


def _loss_scale(jmp, kind):
    if kind == "dynamic":
        return jmp.DynamicLossScale(jnp.float32(2.0**15), period=3)
    if kind == "static":
        return jmp.StaticLossScale(jnp.float32(2.0**10))
    return jmp.NoOpLossScale()


def _program(jmp, kind):
    """jmp's loop; ``jmp`` is the module a user imported."""
    policy = jmp.get_policy("p=f32,c=f16,o=f32")
    loss_scale = _loss_scale(jmp, kind)
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (4, 8)),
        "b1": jnp.zeros(8),
        "w2": jax.random.normal(k2, (8, 1)),
    }
    opt = optax.adam(1e-2)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, loss_scale, x, y):
        def loss_fn(p):
            p, x16 = policy.cast_to_compute((p, x))
            out = policy.cast_to_output(jnp.tanh(x16 @ p["w1"] + p["b1"]) @ p["w2"])
            return loss_scale.scale(jnp.mean((out - y) ** 2))

        grads = policy.cast_to_param(jax.grad(loss_fn)(params))
        grads = loss_scale.unscale(grads)
        grads_finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(grads_finite)
        updates, new_opt_state = opt.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(
            grads_finite, (new_params, new_opt_state), (params, opt_state)
        )
        return params, opt_state, loss_scale, grads_finite

    rng = np.random.default_rng(0)
    out = []
    for i in range(STEPS):
        x = rng.normal(size=(32, 4)).astype(np.float32)
        if i in OVERFLOW:
            x[0, 0] = OVERFLOW[i]
        y = rng.normal(size=(32, 1)).astype(np.float32)
        params, opt_state, loss_scale, finite = step(params, opt_state, loss_scale, x, y)
        counter = getattr(loss_scale, "counter", np.int32(0))
        out.append(
            jax.tree_util.tree_map(
                np.asarray, (params, opt_state, loss_scale.loss_scale, counter, finite)
            )
        )
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dynamic", "static", "no_op"])
def test_jmp_adam_program_bit_identical_with_the_import_changed(kind):
    theirs, ours = _program(real_jmp, kind), _program(our_jmp, kind)
    for i, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        assert_bits_equal(a, b, f"{kind} step {i}")
    skipped = [i for i, s in enumerate(ours) if not bool(s[-1])]
    adam = ours[-1][1][0]
    assert int(adam.count) == STEPS - len(skipped)  # Adam's state advanced on good steps only
    scales = [float(s[2]) for s in ours]
    injected = [2, 6, 11, 17]  # the inf and nan written into the batch (3e4 stays finite)
    if kind == "dynamic":
        # Beside the injected steps, the starting 2**15 may overflow the float16 backward pass
        # once before the first backoff, at a step the backend's rounding decides (XLA:CPU:
        # step 0; an H200: step 1, its fusions keeping float32 inside): either way the two
        # programs agreed bit for bit above, and the scale fits from 2**14 on.
        extra = [i for i in skipped if i not in injected]
        assert set(injected) <= set(skipped) and len(extra) <= 1
        assert all(scales[j] == 2.0**15 for i in extra for j in range(i))  # none backed off
        # jmp's rule, by hand: halve on an overflow (floor 1), double after 3 good steps in a
        # row. On XLA:CPU: 4, 4, 2, 2, 2, 4, 2, ... times 2**12.
        scale, good_run, want = 2.0**15, 0, []
        for i in range(STEPS):
            if i in skipped:
                scale, good_run = max(scale / 2, 1.0), 0
            else:
                good_run += 1
                if good_run == 3:
                    scale, good_run = scale * 2, 0
            want.append(scale)
        assert scales == want
    else:
        assert skipped == injected
        assert scales == [2.0**10 if kind == "static" else 1.0] * STEPS


@pytest.mark.parametrize(
    "name",
    [
        "f32",
        "full",
        "f16",
        "half",
        "bf16",
        "c=f16",
        "p=f16,c=f16",
        "p=f16,c=bf16",
        "params=f32,compute=f16,output=f32",
        "c=half,o=full",
    ],
)
def test_get_policy_matches_jmp(name):
    ours, theirs = our_jmp.get_policy(name), real_jmp.get_policy(name)
    fields = ("param_dtype", "compute_dtype", "output_dtype")
    assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields]
    assert str(ours) == str(theirs)
    tree = {"a": jnp.ones(2), "b": np.ones(2, np.int32), "c": 1.0}
    for cast in ("cast_to_param", "cast_to_compute", "cast_to_output"):
        assert_bits_equal(getattr(ours, cast)(tree), getattr(theirs, cast)(tree), cast)
    half = ours.with_output_dtype(jnp.float16)
    assert half.output_dtype == jnp.float16 and dataclasses.is_dataclass(half)


def test_get_policy_rejects_what_jmp_rejects():
    for bad in ["x=f16", "p=f8", "f8"]:
        with pytest.raises(ValueError):
            real_jmp.get_policy(bad)
        with pytest.raises(ValueError):
            our_jmp.get_policy(bad)


def test_casts_and_half_dtype_match_jmp():
    tree = {"a": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2, jnp.int8)}
    assert our_jmp.half_dtype() == real_jmp.half_dtype()
    assert_bits_equal(our_jmp.cast_to_full(tree), real_jmp.cast_to_full(tree))
    assert_bits_equal(our_jmp.cast_to_half(tree), real_jmp.cast_to_half(tree))


@pytest.mark.slow
def test_static_and_no_op_loss_scales_match_jmp():
    tree = {"a": jnp.array([1.0, 3.0], jnp.float32), "b": jnp.array(2.0, jnp.float16)}
    for ours, theirs in [
        (our_jmp.StaticLossScale(jnp.float32(128.0)), real_jmp.StaticLossScale(jnp.float32(128.0))),
        (our_jmp.NoOpLossScale(), real_jmp.NoOpLossScale()),
        (our_jmp.DynamicLossScale(jnp.float32(3.0)), real_jmp.DynamicLossScale(jnp.float32(3.0))),
    ]:
        assert_bits_equal(ours.scale(tree), theirs.scale(tree))
        assert_bits_equal(ours.unscale(tree), theirs.unscale(tree))
        assert ours.adjust(jnp.array(False)).loss_scale is not None
        assert float(np.asarray(ours.loss_scale)) == float(np.asarray(theirs.loss_scale))
    for t in [{}, {"a": jnp.ones(2)}, {"a": jnp.array([1.0, jnp.nan])}, {"i": jnp.ones(2, int)}]:
        assert bool(our_jmp.all_finite(t)) == bool(real_jmp.all_finite(t))
    with pytest.raises(ValueError, match="pred"):
        our_jmp.select_tree(jnp.ones(2, bool), tree, tree)


def _jaxpr(f, *args):
    return str(jax.make_jaxpr(f)(*args))


def test_select_tree_is_jmps_per_leaf_select():
    a = {"f": jnp.ones(3), "h": jnp.ones(2, jnp.float16), "i": jnp.ones(2, jnp.int32)}
    b = jax.tree_util.tree_map(jnp.zeros_like, a)
    for pred in (jnp.array(True), jnp.array(False)):
        assert_bits_equal(our_jmp.select_tree(pred, a, b), real_jmp.select_tree(pred, a, b))
    # The same program: one select_n per leaf, no cond (a cond changes XLA's fusions).
    pred = jnp.array(True)
    assert _jaxpr(our_jmp.select_tree, pred, a, b) == _jaxpr(real_jmp.select_tree, pred, a, b)
    assert "cond" not in _jaxpr(our_jmp.select_tree, pred, a, b)
    assert our_jmp.select_tree(pred, None, None) is None
    # Mismatched trees fail as in jmp: structure (ValueError), dtype and shape (TypeError).
    for other, error in [
        ({"f": b["f"], "h": b["h"]}, ValueError),
        ({**b, "h": jnp.zeros(2, jnp.float32)}, TypeError),
        ({**b, "f": jnp.zeros(2)}, TypeError),
    ]:
        with pytest.raises(error) as theirs:
            real_jmp.select_tree(pred, a, other)
        with pytest.raises(error) as ours:
            our_jmp.select_tree(pred, a, other)
        assert str(ours.value) == str(theirs.value)


def test_static_and_no_op_loss_scales_are_empty_pytrees_as_in_jmp():
    x = jnp.array([1.0, 3.0], jnp.float16)
    for make in [
        lambda m: m.StaticLossScale(jnp.float32(128.0)),
        lambda m: m.StaticLossScale(2),
        lambda m: m.NoOpLossScale(),
    ]:
        ours, theirs = make(our_jmp), make(real_jmp)
        assert jax.tree_util.tree_leaves(ours) == [] == jax.tree_util.tree_leaves(theirs)
        assert jax.tree_util.tree_map(lambda v: v, ours) is ours  # the object is the treedef

        def step(ls, x):
            return ls.unscale(ls.scale(x)), ls.adjust(jnp.array(True))

        # Inside jit the scale is a constant of the program, the same program as jmp's.
        assert _jaxpr(step, ours, x) == _jaxpr(step, theirs, x)
        out, back = jax.jit(step)(ours, x)
        assert_bits_equal(out, jax.jit(step)(theirs, x)[0])
        assert back is ours
    # A Python number is kept: it multiplies a float16 tree in float16, as in jmp.
    assert our_jmp.StaticLossScale(2).scale(x).dtype == jnp.float16
    # As in jmp, each value compiles anew (a constant of the program).
    traces = []

    @jax.jit
    def scaled(ls, x):
        traces.append(None)
        return ls.scale(x)

    for value in (128.0, 128.0, 256.0):
        scaled(our_jmp.StaticLossScale(jnp.float32(value)), x)
    assert len(traces) == 2


def test_dynamic_loss_scale_object_keeps_min_loss_scale_through_jit():
    # jmp's own flattening drops min_loss_scale (back to 1); here it is a static field.
    ls = our_jmp.DynamicLossScale(jnp.float32(8.0), min_loss_scale=4.0)
    ls = jax.jit(lambda ls: ls.adjust(jnp.array(False)).adjust(jnp.array(False)))(ls)
    assert float(ls.loss_scale) == 4.0 and ls.min_loss_scale == 4.0
    assert ls.policy == our_jmp.dynamic_loss_scale_policy(4.0, 0, 2000, 2, 4.0)
    with pytest.raises(ValueError, match="period must be a whole"):
        our_jmp.DynamicLossScale(8.0, period=5.5)
    with pytest.raises(ValueError, match="counter must be in"):
        our_jmp.DynamicLossScale(8.0, 5, 5)
